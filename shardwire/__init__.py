"""shardwire: one large language model, split by layers across machines, over plain TCP."""

__version__ = "0.1.0"
