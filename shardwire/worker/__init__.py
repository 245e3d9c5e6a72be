"""The worker: a long-running process that serves the stages a coordinator assigns it.

server.py accepts and authenticates connections and dispatches their messages; assign.py checks
an ASSIGN and builds its stages; weights.py finds each tensor (own model file, cache, or the
wire); ring.py runs the stages and forwards activations straight to the next stage's worker.
"""

from .server import InsecureBind, Worker

__all__ = ["InsecureBind", "Worker"]
