"""Where a worker finds the bytes of each tensor it is assigned: its own copy of the model file
(same size, same content hash), its content-addressed cache, or streamed from the coordinator
in WEIGHTS chunks and written to the cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..formats import TensorInfo, TensorReader
from ..weights.cache import CacheWriter, WeightCache
from ..wire.conn import Connection
from ..wire.frames import FrameError
from ..wire.messages import SOURCE_KINDS, Assign, Need, TensorSpec, Weights

log = logging.getLogger("shardwire.worker")


@dataclass
class FoundWeights:
    """Every tensor of a plan, by hash: where it lies and which kind of source it came from."""

    infos: dict[str, TensorInfo] = field(default_factory=dict)
    kinds: dict[str, str] = field(default_factory=dict)
    reader: TensorReader = field(default_factory=TensorReader)

    def bytes_by_source(self, assign: Assign) -> dict[str, int]:
        counts = dict.fromkeys(SOURCE_KINDS, 0)
        for spec in assign.stages:
            for t in spec.tensors:
                counts[self.kinds[t.hash]] += t.nbytes
        return counts


class WeightSources:
    def __init__(self, cache: WeightCache, model_dirs: list[Path]):
        self.cache, self.model_dirs = cache, model_dirs

    def gather(self, conn: Connection, assign: Assign, request: int) -> FoundWeights:
        """Find every tensor locally (own model file, then cache) and ask the coordinator for
        the rest with a NEED, reading its WEIGHTS until each is complete and verified."""
        found = FoundWeights()
        specs = {t.hash: t for s in assign.stages for t in s.tensors}
        for digest, t in specs.items():
            info, kind = self._own_copy(t, found.reader), "file"
            if info is None:
                path = self.cache.lookup(digest, t.nbytes)
                info, kind = (_info(t, path) if path else None), "cache"
            if info is not None:
                found.infos[digest], found.kinds[digest] = info, kind
        needed = sorted(set(specs) - set(found.infos))
        conn.send(Need(needed), request=request)
        try:
            failure = self._receive(conn, {h: specs[h] for h in needed}, found)
        except BaseException:
            found.reader.close()
            raise
        if failure is not None:
            found.reader.close()
            message = (
                f"weight cache {self.cache.directory} cannot be written: {failure}; "
                "free space there, or start the worker with another --cache-dir"
            )
            log.error("%s", message)
            conn.send_error("cache", message, request=request)
            raise failure
        return found

    def _receive(self, conn: Connection, needed: dict[str, TensorSpec], found: FoundWeights) -> OSError | None:
        """Read WEIGHTS until every needed tensor is complete, each written to the cache and
        verified. When the cache cannot be written (a full disk), what it holds stays whole: the
        partial files go, the rest of the stream is read and dropped, and the error is returned,
        so the coordinator hears it in answer rather than a connection cut mid-stream."""
        left = {digest: t.nbytes for digest, t in needed.items()}
        writers: dict[str, CacheWriter] = {}
        failure: OSError | None = None
        try:
            while any(left.values()):
                frame = conn.expect_frame(Weights)
                chunk = Weights.parse(frame.header)
                t = needed.get(chunk.hash)
                if t is None or chunk.total != t.nbytes:
                    raise FrameError("WEIGHTS for a tensor that was not asked for")
                if chunk.offset != t.nbytes - left[chunk.hash] or len(frame.payload) > left[chunk.hash]:
                    raise FrameError(
                        f"WEIGHTS for {chunk.hash[:12]}: chunk at {chunk.offset} out of order or past the end"
                    )
                left[chunk.hash] -= len(frame.payload)
                if failure is not None:
                    continue
                try:
                    writer = writers.get(chunk.hash)
                    if writer is None:
                        writer = writers[chunk.hash] = self.cache.writer(chunk.hash, chunk.total)
                    writer.write(chunk.offset, frame.payload)
                    if writer.done:
                        found.infos[chunk.hash] = _info(t, writer.finish())
                        found.kinds[chunk.hash] = "streamed"
                except OSError as e:
                    failure = e
                    _abort(writers)
        except BaseException:
            _abort(writers)
            raise
        return failure

    def _own_copy(self, t: TensorSpec, reader: TensorReader) -> TensorInfo | None:
        for path in self._candidates(t.file):
            try:
                if path.stat().st_size != t.file_size:
                    continue
            except OSError:
                continue
            info = TensorInfo(t.name, t.dtype, tuple(t.shape), path, t.offset, t.nbytes)
            if t.offset + t.nbytes <= t.file_size and self.cache.index.hashes([info], reader)[t.name] == t.hash:
                return info
        return None

    def _candidates(self, name: str) -> list[Path]:
        """Files called `name` directly in a model folder or one level down."""
        found = []
        for folder in self.model_dirs:
            if (folder / name).is_file():
                found.append(folder / name)
            try:
                found += [d / name for d in folder.iterdir() if d.is_dir() and (d / name).is_file()]
            except OSError:
                pass
        return found


def _info(t: TensorSpec, path: Path) -> TensorInfo:
    """A tensor that fills a cache file of its own."""
    return TensorInfo(t.name, t.dtype, tuple(t.shape), path, 0, t.nbytes)


def _abort(writers: dict[str, CacheWriter]) -> None:
    """Remove the partial files of the tensors not yet complete."""
    for w in writers.values():
        if not w.done:
            w.abort()
