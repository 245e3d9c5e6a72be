"""Every message header that crosses the network, and the checks each field must pass.

Parsers take the decoded msgpack map of a frame and return a typed message or raise
FrameError naming the field. They check shape and range only; whether a value fits the
current plan (a slot, a layer range, a memory budget) is the receiver's check.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .frames import FrameError

MAX_ROWS = 4096
MAX_DIM = 1 << 20
MAX_TOKENS_PER_STEP = 1 << 20
MAX_ELEMENTS = 1 << 31
HASH_LEN = 64  # sha256 hex
TENSOR_DTYPES = {"int32": 4, "float32": 4, "float16": 2, "bfloat16": 2}
STORED_DTYPES = {"F32", "F16", "BF16", "F64", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K",
                 "Q4_K", "Q5_K", "Q6_K"}
COMPUTE_DTYPES = {"float32", "float16", "bfloat16"}
WEIGHT_MODES = {"fast", "dequant", "packed", "compact"}


def _get(h: dict, key: str, kind, what: str):
    if key not in h:
        raise FrameError(f"{what}: missing field '{key}'")
    value = h[key]
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FrameError(f"{what}: field '{key}' has the wrong type")
    if kind is float and not math.isfinite(value):
        raise FrameError(f"{what}: field '{key}' is not finite")
    return value


def _int(h: dict, key: str, what: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    value = _get(h, key, int, what)
    if not lo <= value <= hi:
        raise FrameError(f"{what}: field '{key}'={value} is outside [{lo}, {hi}]")
    return value


def _str(h: dict, key: str, what: str, max_len: int = 4096, choices=None) -> str:
    value = _get(h, key, str, what)
    if len(value) > max_len:
        raise FrameError(f"{what}: field '{key}' is too long")
    if choices is not None and value not in choices:
        raise FrameError(f"{what}: field '{key}'={value!r} is not one of {sorted(choices)}")
    return value


def _bytes(h: dict, key: str, what: str, max_len: int = 64) -> bytes:
    value = _get(h, key, bytes, what)
    if len(value) > max_len:
        raise FrameError(f"{what}: field '{key}' is too long")
    return value


def _list(h: dict, key: str, what: str, max_len: int) -> list:
    value = _get(h, key, list, what)
    if len(value) > max_len:
        raise FrameError(f"{what}: field '{key}' has more than {max_len} entries")
    return value


def _map(value, what: str) -> dict:
    if not isinstance(value, dict):
        raise FrameError(f"{what}: expected a map")
    return value


# -- handshake ---------------------------------------------------------------------------

@dataclass
class Hello:
    role: str  # "coordinator" | "peer"
    nonce: bytes

    @classmethod
    def parse(cls, h: dict) -> "Hello":
        nonce = _bytes(h, "nonce", "HELLO", 64)
        if len(nonce) < 16:
            raise FrameError("HELLO: nonce is too short")
        return cls(_str(h, "role", "HELLO", choices={"coordinator", "peer"}), nonce)


@dataclass
class Challenge:
    nonce: bytes
    worker_id: str
    auth: bool  # whether the worker requires a token

    @classmethod
    def parse(cls, h: dict) -> "Challenge":
        nonce = _bytes(h, "nonce", "CHALLENGE", 64)
        if len(nonce) < 16:
            raise FrameError("CHALLENGE: nonce is too short")
        return cls(nonce, _str(h, "worker_id", "CHALLENGE", 256), _get(h, "auth", bool, "CHALLENGE"))


@dataclass
class Welcome:
    proof: bytes  # HMAC proving the worker knows the token too; empty when it has none

    @classmethod
    def parse(cls, h: dict) -> "Welcome":
        return cls(_bytes(h, "proof", "WELCOME"))


@dataclass
class Auth:
    proof: bytes

    @classmethod
    def parse(cls, h: dict) -> "Auth":
        return cls(_bytes(h, "proof", "AUTH"))


@dataclass
class Error:
    code: str
    message: str

    @classmethod
    def parse(cls, h: dict) -> "Error":
        return cls(_str(h, "code", "ERROR", 64), _str(h, "message", "ERROR", 4096))


# -- devices and plans -------------------------------------------------------------------

@dataclass
class DeviceInfo:
    name: str
    free: int
    total: int
    dtype: str | None = None  # the compute dtype the worker's own hardware does best

    @classmethod
    def parse(cls, d, what: str = "DEVICES") -> "DeviceInfo":
        d = _map(d, what)
        dtype = _str(d, "dtype", what, 16, COMPUTE_DTYPES) if "dtype" in d else None
        return cls(_str(d, "name", what, 64), _int(d, "free", what), _int(d, "total", what), dtype)


@dataclass
class Devices:
    worker_id: str
    version: str
    devices: list[DeviceInfo]

    @classmethod
    def parse(cls, h: dict) -> "Devices":
        devices = [DeviceInfo.parse(d) for d in _list(h, "devices", "DEVICES", 64)]
        return cls(_str(h, "worker_id", "DEVICES", 256), _str(h, "version", "DEVICES", 64), devices)


@dataclass
class TensorSpec:
    name: str
    dtype: str  # stored type, e.g. "Q4_K"
    shape: list[int]
    nbytes: int
    hash: str  # sha256 of the stored bytes, hex
    file: str  # base name of the model file holding it at the coordinator
    file_size: int
    offset: int

    @classmethod
    def parse(cls, d) -> "TensorSpec":
        d, what = _map(d, "ASSIGN tensor"), "ASSIGN tensor"
        shape = _list(d, "shape", what, 4)
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= 1 << 31 for x in shape):
            raise FrameError(f"{what}: bad shape")
        digest = _str(d, "hash", what, HASH_LEN)
        if len(digest) != HASH_LEN or any(c not in "0123456789abcdef" for c in digest):
            raise FrameError(f"{what}: hash is not a sha256 hex digest")
        file = _str(d, "file", what, 255)
        if "/" in file or "\\" in file or file in ("", ".", ".."):
            raise FrameError(f"{what}: file must be a plain base name")
        return cls(_str(d, "name", what, 128), _str(d, "dtype", what, 8, STORED_DTYPES), shape,
                   _int(d, "nbytes", what, 1, 1 << 40), digest, file, _int(d, "file_size", what),
                   _int(d, "offset", what))


@dataclass
class StageSpec:
    index: int
    device: str
    start: int
    end: int
    first: bool
    last: bool
    dtype: str
    tensors: list[TensorSpec]
    weights: str = "dequant"  # how quantized weights live on the device: dequant | packed | compact

    @classmethod
    def parse(cls, d) -> "StageSpec":
        d, what = _map(d, "ASSIGN stage"), "ASSIGN stage"
        tensors = [TensorSpec.parse(t) for t in _list(d, "tensors", what, 1 << 16)]
        stage = cls(_int(d, "index", what, 0, 1 << 16), _str(d, "device", what, 32),
                    _int(d, "start", what, 0, 1 << 16), _int(d, "end", what, 0, 1 << 16),
                    _get(d, "first", bool, what), _get(d, "last", bool, what),
                    _str(d, "dtype", what, 16, COMPUTE_DTYPES), tensors,
                    _str(d, "weights", what, 16, WEIGHT_MODES) if "weights" in d else "dequant")
        if stage.start > stage.end:
            raise FrameError(f"{what}: start {stage.start} > end {stage.end}")
        return stage


@dataclass
class Assign:
    plan: str
    config: dict
    qk_interleaved: bool
    n_slots: int
    ctx: int
    stages: list[StageSpec]
    next_host: str | None  # the worker holding the following stage; None after the last
    next_port: int | None
    next_fingerprint: str | None = None  # its TLS certificate, as the coordinator verified it
    coordinator: str = ""  # which coordinator sent it: the same one may take its plan over

    @classmethod
    def parse(cls, h: dict) -> "Assign":
        what = "ASSIGN"
        stages = [StageSpec.parse(s) for s in _list(h, "stages", what, 64)]
        if not stages:
            raise FrameError(f"{what}: no stages")
        for a, b in zip(stages, stages[1:]):
            if b.start != a.end or b.index != a.index + 1:
                raise FrameError(f"{what}: stages are not consecutive")
        nxt = h.get("next")
        host = port = fp = None
        if nxt is not None:
            nxt = _map(nxt, what)
            host, port = _str(nxt, "host", what, 255), _int(nxt, "port", what, 1, 65535)
            if nxt.get("fingerprint") is not None:
                fp = _str(nxt, "fingerprint", what, 71)
                if not fp.startswith("sha256:") or len(fp) != 71:
                    raise FrameError(f"{what}: next fingerprint is not sha256:<64 hex>")
        return cls(_str(h, "plan", what, 64), _map(_get(h, "config", dict, what), what),
                   _get(h, "qk_interleaved", bool, what), _int(h, "n_slots", what, 1, 4096),
                   _int(h, "ctx", what, 1, 1 << 24), stages, host, port, fp,
                   _str(h, "coordinator", what, 64) if "coordinator" in h else "")


@dataclass
class Need:
    hashes: list[str]

    @classmethod
    def parse(cls, h: dict) -> "Need":
        hashes = _list(h, "hashes", "NEED", 1 << 16)
        if not all(isinstance(x, str) and len(x) == HASH_LEN for x in hashes):
            raise FrameError("NEED: bad hash")
        return cls(hashes)


@dataclass
class Weights:
    hash: str
    offset: int
    total: int

    @classmethod
    def parse(cls, h: dict) -> "Weights":
        what = "WEIGHTS"
        digest = _str(h, "hash", what, HASH_LEN)
        if len(digest) != HASH_LEN:
            raise FrameError(f"{what}: bad hash")
        return cls(digest, _int(h, "offset", what, 0, 1 << 40), _int(h, "total", what, 1, 1 << 40))


@dataclass
class Ready:
    stages: list[dict] = field(default_factory=list)  # per stage: weight/kv bytes, weight sources

    @classmethod
    def parse(cls, h: dict) -> "Ready":
        return cls([_map(s, "READY") for s in _list(h, "stages", "READY", 64)])


# -- the data path -----------------------------------------------------------------------

@dataclass
class Forward:
    plan: str
    step: int
    rows: list[tuple[int, int, int]]  # (slot, start position, new tokens)
    sampling: list[dict | None]  # per row; None = fill the cache only
    recent: list[list[int]]  # per row: tokens for repetition penalties
    dtype: str  # payload: "int32" token ids, or hidden states
    shape: list[int]  # [rows, tokens per row] for ids, [rows, tokens per row, dim] for hidden

    @classmethod
    def parse(cls, h: dict) -> "Forward":
        what = "FORWARD"
        rows = _list(h, "rows", what, MAX_ROWS)
        if not rows:
            raise FrameError(f"{what}: no rows")
        parsed = []
        for r in rows:
            if (not isinstance(r, list) or len(r) != 3
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in r)):
                raise FrameError(f"{what}: a row must be [slot, start, n] of non-negative ints")
            parsed.append(tuple(r))
        widths = {r[2] for r in parsed}
        if len(widths) != 1 or 0 in widths:
            raise FrameError(f"{what}: rows must all carry the same positive number of tokens")
        sampling = _list(h, "sampling", what, MAX_ROWS)
        recent = _list(h, "recent", what, MAX_ROWS)
        if len(sampling) != len(parsed) or len(recent) != len(parsed):
            raise FrameError(f"{what}: sampling and recent must have one entry per row")
        for s in sampling:
            if s is not None:
                _map(s, what)
        for r in recent:
            if not isinstance(r, list) or len(r) > 4096 or not all(isinstance(x, int) and 0 <= x < 1 << 31 for x in r):
                raise FrameError(f"{what}: recent tokens must be lists of token ids")
        dtype = _str(h, "dtype", what, 16, TENSOR_DTYPES)
        shape = _list(h, "shape", what, 3)
        if not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_DIM for x in shape):
            raise FrameError(f"{what}: bad shape")
        n = widths.pop()
        if len(shape) < 2 or shape[0] != len(parsed) or shape[1] != n or len(parsed) * n > MAX_TOKENS_PER_STEP:
            raise FrameError(f"{what}: shape {shape} does not match {len(parsed)} rows of {n} tokens")
        if math.prod(shape) > MAX_ELEMENTS:
            raise FrameError(f"{what}: shape {shape} has more than {MAX_ELEMENTS} elements")
        if (dtype == "int32") != (len(shape) == 2):
            raise FrameError(f"{what}: token ids are [rows, n] int32; hidden states are [rows, n, dim]")
        return cls(_str(h, "plan", what, 64), _int(h, "step", what), parsed, sampling, recent, dtype, shape)

    def payload_nbytes(self) -> int:
        n = TENSOR_DTYPES[self.dtype]
        for d in self.shape:
            n *= d
        return n

    def to_header(self) -> dict:
        return {"plan": self.plan, "step": self.step, "rows": [list(r) for r in self.rows],
                "sampling": self.sampling, "recent": self.recent, "dtype": self.dtype, "shape": self.shape}


@dataclass
class Result:
    step: int
    tokens: list[int | None]
    logprobs: list[list | None]  # per row: [chosen logprob, [[id, logprob], ...]] or None

    @classmethod
    def parse(cls, h: dict) -> "Result":
        tokens = _list(h, "tokens", "RESULT", MAX_ROWS)
        logprobs = _list(h, "logprobs", "RESULT", MAX_ROWS)
        if not all(t is None or (isinstance(t, int) and t >= 0) for t in tokens) or len(logprobs) != len(tokens):
            raise FrameError("RESULT: bad tokens")
        return cls(_int(h, "step", "RESULT"), tokens, logprobs)


@dataclass
class Free:
    slot: int

    @classmethod
    def parse(cls, h: dict) -> "Free":
        return cls(_int(h, "slot", "FREE", 0, 4095))
