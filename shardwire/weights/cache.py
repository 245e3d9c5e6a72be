"""Content hashes of tensors and the worker's content-addressed weight cache.

A tensor is known by the sha256 of its stored bytes. Hashing a model once is unavoidable;
hashing it at every start is not, so hashes of byte ranges are remembered per file identity
(path, size, mtime, inode): a file that changes in any way is hashed again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..formats import TensorInfo, TensorReader

log = logging.getLogger("shardwire.weights.cache")


def default_cache_dir() -> Path:
    if os.environ.get("SHARDWIRE_CACHE"):
        return Path(os.environ["SHARDWIRE_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "shardwire"


def sha256(data) -> str:
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()


def _identity(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
    return hashlib.sha1(key.encode()).hexdigest()


class HashIndex:
    """Remembered sha256 of (file, offset, length) ranges, invalidated when the file changes."""

    def __init__(self, directory: Path):
        self.directory = directory / "hashes"
        self._lock = threading.Lock()
        self._loaded: dict[str, dict[str, str]] = {}

    def _entries(self, identity: str) -> dict[str, str]:
        if identity not in self._loaded:
            path = self.directory / f"{identity}.json"
            try:
                self._loaded[identity] = json.loads(path.read_text())
            except (OSError, ValueError):
                self._loaded[identity] = {}
        return self._loaded[identity]

    def hashes(self, infos: list[TensorInfo], reader: TensorReader, threads: int = 4) -> dict[str, str]:
        """sha256 of each tensor's stored bytes, keyed by tensor name; computes only what is new."""
        out: dict[str, str] = {}
        todo: list[tuple[TensorInfo, str, str]] = []
        with self._lock:
            for info in infos:
                identity = _identity(info.path)
                key = f"{info.offset}:{info.nbytes}" + (f":{info.name}" if info.derive is not None else "")
                known = self._entries(identity).get(key)
                if known:
                    out[info.name] = known
                else:
                    todo.append((info, identity, key))
        if todo:

            def hash_and_release(info: TensorInfo) -> str:
                value = sha256(reader.read(info))
                reader.release(info)  # hashing a model must not leave it resident
                return value

            with ThreadPoolExecutor(max_workers=threads) as pool:
                digests = list(pool.map(lambda t: hash_and_release(t[0]), todo))
            with self._lock:
                for (info, identity, key), digest in zip(todo, digests):
                    self._entries(identity)[key] = digest
                    out[info.name] = digest
                self._save({identity for _, identity, _ in todo})
        return out

    def remember(self, path: Path, offset: int, nbytes: int, digest: str) -> None:
        with self._lock:
            identity = _identity(path)
            self._entries(identity)[f"{offset}:{nbytes}"] = digest
            self._save({identity})

    def _save(self, identities: set[str]) -> None:
        """Write the remembered hashes; a failure (a full disk) costs only hashing again later."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            for identity in identities:
                tmp = self.directory / f"{identity}.json.tmp{os.getpid()}"
                try:
                    tmp.write_text(json.dumps(self._entries(identity)))
                    os.replace(tmp, self.directory / f"{identity}.json")
                finally:
                    tmp.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not remember tensor hashes in %s: %s", self.directory, e)


class WeightCache:
    """Tensor bytes stored under their sha256; verified before use, evicted least recently used."""

    def __init__(self, directory: Path, max_bytes: int | None = None):
        self.directory = directory / "weights"
        self.max_bytes = max_bytes
        self.index = HashIndex(directory)

    def path_for(self, digest: str) -> Path:
        return self.directory / digest[:2] / digest

    def lookup(self, digest: str, nbytes: int) -> Path | None:
        """The cached file for `digest` if it is present and its contents hash right."""
        path = self.path_for(digest)
        if not path.is_file() or path.stat().st_size != nbytes:
            return None
        info = TensorInfo(digest, "U8", (nbytes,), path, 0, nbytes)
        reader = TensorReader()
        try:
            actual = self.index.hashes([info], reader)[digest]
        finally:
            reader.close()
        if actual != digest:
            path.unlink(missing_ok=True)  # corrupted: drop it, it will be fetched again
            return None
        # Most recently used: the access time carries it, so the modification time the hash index
        # keys on stays put and the next lookup finds this hash remembered.
        os.utime(path, ns=(time.time_ns(), path.stat().st_mtime_ns))
        return path

    def writer(self, digest: str, total: int) -> "CacheWriter":
        return CacheWriter(self, digest, total)

    def evict(self, keep: set[str]) -> int:
        """Remove least recently used files until the cache is under its limit; returns bytes freed."""
        if self.max_bytes is None or not self.directory.is_dir():
            return 0
        files = sorted(
            (p for p in self.directory.glob("*/*") if p.is_file() and ".part" not in p.name),
            key=lambda p: p.stat().st_atime,
        )
        total = sum(p.stat().st_size for p in files)
        freed = 0
        for p in files:
            if total - freed <= self.max_bytes:
                break
            if p.name in keep:
                continue
            freed += p.stat().st_size
            p.unlink(missing_ok=True)
        return freed


class CacheWriter:
    """Receives one tensor's bytes in chunks, then verifies the hash before it enters the cache."""

    def __init__(self, cache: WeightCache, digest: str, total: int):
        self.cache, self.digest, self.total = cache, digest, total
        self.final = cache.path_for(digest)
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.part = self.final.with_name(f"{digest}.part{os.getpid()}.{threading.get_ident()}")
        self.file = open(self.part, "wb")
        try:
            self.file.truncate(total)
        except BaseException:
            self.abort()
            raise
        self.hasher = hashlib.sha256()
        self.received = 0

    def write(self, offset: int, data) -> None:
        if offset != self.received or self.received + len(data) > self.total:
            raise ValueError(f"weights for {self.digest[:12]}: chunk at {offset} out of order or past the end")
        self.file.write(data)
        self.hasher.update(data)
        self.received += len(data)

    @property
    def done(self) -> bool:
        return self.received == self.total

    def finish(self) -> Path:
        """Move the verified file into the cache; on any failure (a full disk) the partial file goes."""
        try:
            self.file.close()
            if self.hasher.hexdigest() != self.digest:
                raise ValueError(f"weights for {self.digest[:12]} arrived corrupted (hash mismatch)")
            os.replace(self.part, self.final)
        except BaseException:
            self.part.unlink(missing_ok=True)
            raise
        self.cache.index.remember(self.final, 0, self.total, self.digest)
        return self.final

    def abort(self) -> None:
        try:
            self.file.close()  # flushing what is buffered fails on a full disk
        except OSError:
            pass
        finally:
            self.part.unlink(missing_ok=True)
