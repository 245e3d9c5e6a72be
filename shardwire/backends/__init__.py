"""The seam between the reference path (model.py: every block variant any family declares, on
PyTorch's operations) and the backends that run some blocks faster. A backend attaches runners to
a stage's blocks and to the stage; model.py knows only the protocols below, never a backend.

A backend refuses, at attach time and with a log line, every block whose BlockVariant it does not
implement (ggml: backends/ggml IMPLEMENTED); such a block keeps no runner and computes on the
reference path. Adding a backend: a package here with the functions of Backend, and a line in
BACKENDS."""

from __future__ import annotations

from typing import Protocol

import torch

from ..devices import release_memory
from . import ggml


class BlockRunner(Protocol):
    """Runs a whole block's rows (Block.runner)."""

    piece: int | None  # rows of a prompt chunk it takes at once; None: a chunk goes whole

    def takes(self, x: torch.Tensor) -> bool: ...

    def __call__(self, x: torch.Tensor, cache, layer: int, ctx, last_only: bool = False) -> torch.Tensor: ...


class FeedRunner(Protocol):
    """Runs a block's feed-forward half, its residual added (Block.feed_runner), after a token
    mixer the backend does not run."""

    def takes(self, x: torch.Tensor) -> bool: ...

    def feed(self, x: torch.Tensor) -> torch.Tensor: ...


class StageRunner(Protocol):
    """Runs a decode step of every block of a stage at once (Stage.runner)."""

    logits: bool  # whether a call ends with the final norm and head

    def takes(self, x, cache) -> bool: ...

    def __call__(self, x, cache, ctx, per_sequence: int = 1) -> torch.Tensor:
        """A row per position; `per_sequence`: each sequence's rows, in turn (its slot's
        recurrent state goes through them in order)."""


class Backend(Protocol):
    def applies(self, stage) -> bool:
        """Whether it runs anything of a stage on its device, in its dtype."""

    def attach(self, stage) -> None:
        """Runners for the blocks (and the stage) whose variants it implements; a log line for
        the rest."""

    def borrowed(self, x: torch.Tensor) -> bool:
        """Whether x lies in memory of this thread's that its next call overwrites."""

    def release(self) -> None:
        """This thread's intermediates go back to the system."""


BACKENDS: tuple[Backend, ...] = (ggml,)
IDLE_S = 0.5  # a thread that has run no step for this long gives back its scratch memory


def attach(stage) -> None:
    """The first backend that applies to the stage attaches its runners."""
    for backend in BACKENDS:
        if backend.applies(stage):
            backend.attach(stage)
            stage.backend = backend
            return


def detach(stage) -> None:
    """The stage on the reference path alone."""
    stage.runner, stage.backend = None, None
    for block in stage.blocks:
        block.runner = block.feed_runner = None


def release_scratch() -> None:
    """This thread's backend intermediates and the heap's free pages go back to the system, once
    its stages have run no step for IDLE_S. Not after each prompt chunk: the next chunk or prompt
    would map and zero every page of them again (~700 page faults a 64-token prompt of the small
    F32 model); llama.cpp keeps its compute buffer for good."""
    for backend in BACKENDS:
        backend.release()
    release_memory()
