"""The coordinator's side of a cluster.

cluster.py is the facade (connect, plan, load, recover, status); links.py holds one worker's
connection and the thread reading it; shipping.py assigns a worker its stages and streams the
weights it lacks; health.py pings the workers and notices what stopped; remote.py is the
pipeline the engine drives, sending steps into the ring and taking results from its end;
launch.py turns command-line options into a pipeline.
"""

from .cluster import Cluster

__all__ = ["Cluster"]
