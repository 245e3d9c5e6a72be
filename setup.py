"""A wheel that carries ggml's libraries (built by kernels/build_backend.py) is tagged for this
platform; one without them stays pure Python."""

from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution


class _Distribution(Distribution):
    def has_ext_modules(self):
        return (Path(__file__).resolve().parent / "shardwire" / "_ggml" / "lib").is_dir()


setup(distclass=_Distribution)
