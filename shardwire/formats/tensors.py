"""Where a tensor lives in a model file, and a lazy reader that maps only what is asked for."""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class TensorInfo:
    name: str  # canonical (GGUF) name, e.g. "blk.3.attn_q.weight"
    dtype: str  # GGML type name ("F16", "Q4_K", ...); safetensors dtypes use the same names
    shape: tuple[int, ...]  # PyTorch order: (rows, columns)
    path: Path
    offset: int  # absolute byte offset of the data in `path`
    nbytes: int
    # a tensor no file stores as it is (gpt-oss's experts in a Hugging Face folder: transposed,
    # interleaved, MXFP4 in blocks and scales apart): its bytes are derive(the bytes of `parts`),
    # and path and offset are its first part's
    parts: tuple["TensorInfo", ...] = ()
    derive: Callable[..., np.ndarray] | None = None

    @classmethod
    def derived(cls, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, parts: tuple, derive) -> "TensorInfo":
        return cls(name, dtype, tuple(shape), parts[0].path, parts[0].offset, nbytes, tuple(parts), derive)

    def split(self, n: int) -> list["TensorInfo"]:
        """The tensor as `n` equal consecutive parts along its first dimension."""
        if self.derive is not None:
            raise ValueError(f"{self.path}: tensor '{self.name}' is derived from others and has no parts of its own")
        part = self.nbytes // n
        shape = (self.shape[0] // n, *self.shape[1:]) if len(self.shape) > 1 and self.shape[0] % n == 0 else None
        if shape is None or part * n != self.nbytes:
            raise ValueError(f"{self.path}: tensor '{self.name}' of shape {list(self.shape)} has no {n} equal parts")
        if len(self.shape) == 3 and shape[0] == 1:
            shape = shape[1:]
        return [TensorInfo(self.name, self.dtype, shape, self.path, self.offset + i * part, part) for i in range(n)]

    def renamed(self, name: str) -> "TensorInfo":
        return replace(self, name=name)


FAULT_AROUND = 1 << 20  # more than Linux maps around a faulting page of a file (64 KiB by default)
COPY_PIECE = 4 << 20


def copied(raw: np.ndarray, info: TensorInfo, release: Callable[[TensorInfo], None] | None) -> np.ndarray:
    """A tensor's stored bytes (`raw`, read from a mapping) copied out a few MiB at a time, each
    piece's pages released (TensorReader.release) as soon as it is copied: a large tensor is never
    resident twice. A derived tensor's bytes are its own already."""
    if info.derive is not None:
        return raw
    out = np.empty_like(raw)
    for a in range(0, raw.size, COPY_PIECE):
        b = min(a + COPY_PIECE, raw.size)
        out[a:b] = raw[a:b]
        if release is not None:
            release(TensorInfo(info.name, "U8", (b - a,), info.path, info.offset + a, b - a))
    return out


class TensorReader:
    """Reads tensors by memory map, one file mapping each, and counts the bytes it hands out."""

    def __init__(self):
        self._maps: dict[Path, mmap.mmap] = {}
        self._lock = threading.Lock()
        self.bytes_read = 0

    def _map(self, path: Path) -> mmap.mmap:
        with self._lock:
            if path not in self._maps:
                with open(path, "rb") as f:
                    self._maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[path]

    def read(self, info: TensorInfo) -> np.ndarray:
        """The tensor's raw bytes as a read-only uint8 view into the mapping (a derived tensor's:
        an array of their own)."""
        if info.derive is not None:
            out = info.derive(*(self.read(part) for part in info.parts))
            if out.dtype != np.uint8 or out.size != info.nbytes:
                raise ValueError(f"{info.path}: tensor '{info.name}' derived as {out.size} bytes, not {info.nbytes}")
            return out
        data = self._map(info.path)
        if info.offset + info.nbytes > len(data):
            raise ValueError(f"{info.path}: tensor '{info.name}' lies past the end of the file")
        self.bytes_read += info.nbytes
        return np.frombuffer(data, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def release(self, info: TensorInfo) -> None:
        """Drop the tensor's pages from this process's resident memory once its bytes have been
        used (copied or converted); the file stays mapped, so a view still reads them back."""
        for part in info.parts:
            self.release(part)
        if info.derive is not None:
            return
        data = self._maps.get(info.path)
        if data is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        # with a margin: a page fault maps the pages around it too (the kernel's fault-around),
        # which belong to the tensors on either side
        start = max(0, info.offset - FAULT_AROUND) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(len(data), -(-(info.offset + info.nbytes + FAULT_AROUND) // mmap.PAGESIZE) * mmap.PAGESIZE)
        if end > start:
            data.madvise(mmap.MADV_DONTNEED, start, end - start)

    def close(self) -> None:
        with self._lock:
            maps, self._maps = self._maps, {}
        for m in maps.values():
            try:
                m.close()
            except BufferError:
                pass  # a tensor still views it; the mapping goes when that tensor does
