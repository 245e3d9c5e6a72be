"""Assigning a worker its stages: the ASSIGN, the weights it asks for in NEED streamed in chunks,
and its READY."""

from __future__ import annotations

import sys

from ..formats import ModelFile, TensorReader
from ..pipeline import PipelineError
from ..pipeline.plan import PlannedStage
from ..wire.conn import RemoteError
from ..wire.frames import FrameError
from ..wire.messages import Assign, Need, NextHop, OverrideSpec, Ready, StageSpec, TensorSpec, Weights
from .links import WorkerLink

WEIGHT_CHUNK = 8 << 20


def stage_specs(model: ModelFile, stages: list[tuple[int, PlannedStage]], hashes: dict[str, str]) -> list[StageSpec]:
    specs = []
    for index, stage in stages:
        tensors = [
            TensorSpec(
                name,
                info.dtype,
                list(info.shape),
                info.nbytes,
                hashes[name],
                info.path.name,
                info.path.stat().st_size,
                info.offset,
            )
            for name, info in model.stage_tensors(stage.start, stage.end, stage.first, stage.last).items()
        ]
        specs.append(
            StageSpec(
                index,
                stage.device.name,
                stage.start,
                stage.end,
                stage.first,
                stage.last,
                stage.device.dtype,
                stage.weights,
                dict(stage.device.fastest),
                tensors,
                [OverrideSpec(p, d.name, d.dtype, dict(d.fastest)) for p, d in stage.overrides],
            )
        )
    return specs


def next_hop(link: WorkerLink | None) -> NextHop | None:
    return None if link is None else NextHop(link.host, link.port, link.fingerprint)


def assign_and_ship(
    link: WorkerLink, assign: Assign, model: ModelFile, reader: TensorReader, show_progress: bool
) -> Ready:
    """Send `assign`, stream the tensors the worker lacks, and wait for its READY; raises
    PipelineError naming the worker when it refuses or fails."""
    conn = link.conn
    by_hash = {t.hash: model.tensors[t.name] for s in assign.stages for t in s.tensors}
    try:
        conn.send(assign)
        need = conn.expect(Need)
        if any(digest not in by_hash for digest in need.hashes):
            raise FrameError(f"worker {link.name} asked for weights it was not assigned")
        total = sum(by_hash[h].nbytes for h in need.hashes)
        with _progress(show_progress and total > 0, f"sending weights to {link.name}", total) as advance:
            for digest in need.hashes:
                data = reader.read(by_hash[digest])
                for offset in range(0, len(data), WEIGHT_CHUNK):
                    chunk = data[offset : offset + WEIGHT_CHUNK]
                    conn.send(Weights(digest, offset, len(data)), chunk)
                    advance(len(chunk))
                del data
                reader.release(by_hash[digest])  # what was sent need not stay resident here
        return conn.expect(Ready)
    except RemoteError as e:
        raise PipelineError(str(e), link.name) from None
    except (OSError, ConnectionError) as e:
        raise PipelineError(f"worker {link.name} failed while loading: {e}", link.name) from None


class _progress:
    """A rich progress bar on stderr, or nothing; used as `with _progress(...) as advance:`."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total
        self._progress = None

    def __enter__(self):
        if not self.enabled or not sys.stderr.isatty():
            return lambda n: None
        from rich.progress import (
            BarColumn,
            DownloadColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
            TransferSpeedColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self._progress.start()
        task = self._progress.add_task(self.label, total=self.total)
        return lambda n: self._progress.advance(task, n)

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
        return False
