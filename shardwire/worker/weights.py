"""Where a worker finds the bytes of each tensor it is assigned: its own copy of the model file
(same size, same content hash), its content-addressed cache, or streamed from the coordinator
in WEIGHTS chunks and written to the cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..cache import WeightCache
from ..formats import TensorInfo, TensorReader
from ..wire.conn import Connection
from ..wire.frames import FrameError
from ..wire.messages import SOURCE_KINDS, Assign, Need, TensorSpec, Weights


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
        writers = {}
        try:
            while len(writers) < len(needed) or any(not w.done for w in writers.values()):
                frame = conn.expect_frame(Weights)
                chunk = Weights.parse(frame.header)
                if chunk.hash not in needed or chunk.total != specs[chunk.hash].nbytes:
                    raise FrameError("WEIGHTS for a tensor that was not asked for")
                writer = writers.get(chunk.hash)
                if writer is None:
                    writer = writers[chunk.hash] = self.cache.writer(chunk.hash, chunk.total)
                writer.write(chunk.offset, frame.payload)
                if writer.done:
                    found.infos[chunk.hash] = _info(specs[chunk.hash], writer.finish())
                    found.kinds[chunk.hash] = "streamed"
        except BaseException:
            for w in writers.values():
                if not w.done:
                    w.abort()
            found.reader.close()
            raise
        return found

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
