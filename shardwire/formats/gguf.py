"""GGUF header parsing: metadata and tensor index, without touching tensor data.

The `gguf` package's reader builds a numpy view per array element, which takes seconds on a
128k-token vocabulary; this parser reads the same header with `struct` in a fraction of that.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..enums import STORED_TYPES
from .tensors import TensorInfo

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
SPLIT_NAME = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# GGUF metadata value types: (struct format, size) for the fixed-size ones.
_SCALARS = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_STRING, _ARRAY = 8, 9
_ARRAY_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


class GGUFError(ValueError):
    """A GGUF file that cannot be read; the message names the file and the place."""


class _Cursor:
    def __init__(self, data: bytes, path: Path):
        self.data, self.pos, self.path = data, 0, path

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise GGUFError(
                f"{self.path}: truncated GGUF, file ends at byte {len(self.data)} "
                f"while reading {what} (needs {n} bytes at offset {self.pos})"
            )
        chunk = self.data[self.pos : end]
        self.pos = end
        return chunk

    def unpack(self, fmt: str, size: int, what: str):
        return struct.unpack(fmt, self.take(size, what))[0]

    def u32(self, what: str) -> int:
        return self.unpack("<I", 4, what)

    def u64(self, what: str) -> int:
        return self.unpack("<Q", 8, what)

    def string(self, what: str) -> str:
        n = self.u64(what)
        raw = self.take(n, what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int, what: str):
        if vtype in _SCALARS:
            return self.unpack(*_SCALARS[vtype], what)
        if vtype == _STRING:
            return self.string(what)
        if vtype == _ARRAY:
            etype, count = self.u32(what), self.u64(what)
            if etype in _ARRAY_FORMATS:
                size = struct.calcsize(_ARRAY_FORMATS[etype])
                raw = self.take(count * size, what)
                return list(struct.unpack(f"<{count}{_ARRAY_FORMATS[etype]}", raw))
            if etype == _STRING:
                return [self.string(what) for _ in range(count)]
            if etype == _ARRAY:
                return [self.value(_ARRAY, what) for _ in range(count)]
            raise GGUFError(f"{self.path}: unknown array element type {etype} in {what}")
        raise GGUFError(f"{self.path}: unknown metadata value type {vtype} in {what}")


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict
    tensors: dict[str, TensorInfo]
    data_offset: int


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse one GGUF file's header. Tensor data is only located, never read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such model file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise GGUFError(f"{path}: empty file, not a GGUF model")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _parse(_Cursor(data, path), size)


def _parse(cur: _Cursor, file_size: int) -> GGUFFile:
    path = cur.path
    if cur.take(4, "magic") != MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (bad magic)")
    version = cur.u32("version")
    if version not in (2, 3):
        raise GGUFError(f"{path}: unsupported GGUF version {version} (2 and 3 are supported)")
    n_tensors = cur.u64("tensor count")
    n_kv = cur.u64("metadata count")
    if n_tensors > 1 << 24 or n_kv > 1 << 24:
        raise GGUFError(f"{path}: implausible header ({n_tensors} tensors, {n_kv} metadata keys)")

    metadata: dict = {}
    for i in range(n_kv):
        key = cur.string(f"metadata key #{i}")
        vtype = cur.u32(f"type of metadata '{key}'")
        metadata[key] = cur.value(vtype, f"metadata '{key}'")

    raw_infos = []
    for i in range(n_tensors):
        name = cur.string(f"name of tensor #{i}")
        n_dims = cur.u32(f"tensor info '{name}'")
        if n_dims > 8:
            raise GGUFError(f"{path}: tensor '{name}' has {n_dims} dimensions")
        dims = [cur.u64(f"tensor info '{name}'") for _ in range(n_dims)]
        ggml_type = cur.u32(f"tensor info '{name}'")
        offset = cur.u64(f"tensor info '{name}'")
        raw_infos.append((name, dims, ggml_type, offset))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    data_offset = -(-cur.pos // alignment) * alignment

    tensors: dict[str, TensorInfo] = {}
    for name, dims, ggml_type, offset in raw_infos:
        try:
            qtype = GGMLQuantizationType(ggml_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor '{name}' has unknown ggml type {ggml_type}") from None
        if qtype.name not in STORED_TYPES:
            raise GGUFError(
                f"{path}: tensor '{name}' is stored as {qtype.name}, a type shardwire does not read "
                f"(it reads {', '.join(STORED_TYPES)})"
            )
        block, type_size = GGML_QUANT_SIZES[qtype]
        if dims and dims[0] % block:
            raise GGUFError(
                f"{path}: tensor '{name}' row of {dims[0]} is not a multiple of the {qtype.name} block size {block}"
            )
        n_elements = 1
        for d in dims:
            n_elements *= d
        nbytes = n_elements // block * type_size
        start = data_offset + offset
        if start + nbytes > file_size:
            raise GGUFError(
                f"{path}: truncated GGUF, tensor '{name}' needs bytes "
                f"[{start}, {start + nbytes}) but the file has {file_size}"
            )
        tensors[name] = TensorInfo(
            name=name, dtype=qtype.name, shape=tuple(reversed(dims)), path=path, offset=start, nbytes=nbytes
        )
    return GGUFFile(path=path, version=version, metadata=metadata, tensors=tensors, data_offset=data_offset)


def split_parts(path: Path) -> list[Path]:
    """All parts of a model split as `name-0000i-of-0000N.gguf`, or just `path`."""
    m = SPLIT_NAME.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"{path}: split model is missing part(s) {', '.join(missing)}")
    return parts


def read_gguf_model(path: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """Metadata (from the first part) and the tensors of every part of a GGUF model."""
    parts = split_parts(Path(path))
    first = read_gguf(parts[0])
    metadata, tensors = first.metadata, dict(first.tensors)
    for part in parts[1:]:
        tensors.update(read_gguf(part).tensors)
    expected = metadata.get("split.tensors.count")
    if expected is not None and expected != len(tensors):
        raise GGUFError(f"{parts[0]}: split model lists {expected} tensors, its parts hold {len(tensors)}")
    return metadata, tensors
