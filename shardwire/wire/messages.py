"""Every message that crosses the network, declared once: both sides build a frame's header
with `to_wire()` and read it with `parse()`, which checks every field and raises FrameError
naming the one that is wrong.

Parsers check shape and range only; whether a value fits the current plan (a slot, a layer
range, a memory budget) is the receiver's check. `MESSAGES` maps each frame type to its
message; `parse_message` reads any frame's header by it.

Longer than the other modules on purpose: it is the whole protocol, and keeping every message in
one file is what lets a reader check both sides against one declaration.

One module of this length: every message of the protocol declared once for both sides; the whole
protocol is read here.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

from ..enums import (
    COMPUTE_DTYPES,
    PAYLOAD_DTYPES,
    PRODUCT_SOURCES,
    STAGE_WEIGHT_MODES,
    STORED_TYPES,
    WEIGHT_FORMATS,
    pages_for,
)
from .frames import Frame, FrameError, MessageType

MAX_GRAMMAR_BYTES = 128 << 10  # a request's schema or grammar text
MAX_VOCAB = 1 << 20


@dataclass
class Sampled:
    """A token the last stage sampled, with its logprob and the top alternatives where asked."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RowConstraint:
    key: str  # the grammar's sha256
    consumed: int  # generated tokens the matcher has consumed when this row samples
    grammar: str | None = None  # with tokens: (re)build the matcher and consume them first
    tokens: list[int] | None = None

    def to_dict(self) -> dict:
        out = {"key": self.key, "consumed": self.consumed}
        if self.grammar is not None:
            out.update(grammar=self.grammar, tokens=list(self.tokens or []))
        return out

    @classmethod
    def from_dict(cls, d) -> "RowConstraint":
        if not isinstance(d, dict) or set(d) - {"key", "consumed", "grammar", "tokens"}:
            raise ValueError("a row constraint is {key, consumed[, grammar, tokens]}")
        key, consumed, grammar, tokens = d.get("key"), d.get("consumed"), d.get("grammar"), d.get("tokens")
        if not isinstance(key, str) or len(key) != 64:
            raise ValueError("a row constraint's key is a sha256 in hex")
        if not isinstance(consumed, int) or isinstance(consumed, bool) or not 0 <= consumed < 1 << 31:
            raise ValueError("a row constraint's consumed count must be a non-negative int")
        if grammar is not None:
            if not isinstance(grammar, str) or len(grammar) > 4 * MAX_GRAMMAR_BYTES:
                raise ValueError("a row constraint's grammar is too long")
            if not isinstance(tokens, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in tokens
            ):
                raise ValueError("a row constraint's tokens must be a list of token ids")
            if len(tokens) != consumed:
                raise ValueError("a row constraint rebuilds its matcher from exactly `consumed` tokens")
        elif tokens is not None:
            raise ValueError("a row constraint carries tokens only with its grammar")
        return cls(key, consumed, grammar, tokens)


MAX_ROWS = 4096
MAX_DIM = 1 << 20
MAX_TOKENS_PER_STEP = 1 << 20
MAX_ELEMENTS = 1 << 31
HASH_LEN = 64  # sha256 hex
SOURCE_KINDS = ("file", "cache", "streamed")  # where a worker found a tensor's bytes


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


def _hash(h: dict, key: str, what: str) -> str:
    digest = _str(h, key, what, HASH_LEN)
    if len(digest) != HASH_LEN or any(c not in "0123456789abcdef" for c in digest):
        raise FrameError(f"{what}: {key} is not a sha256 hex digest")
    return digest


def _formats(h: dict, key: str, what: str, choices=WEIGHT_FORMATS) -> dict[str, str]:
    """A map of stored type -> one of `choices` (a weight format)."""
    d = _map(_get(h, key, dict, what), what)
    if not all(k in STORED_TYPES and v in choices for k, v in d.items()):
        raise FrameError(f"{what}: {key} must map stored types to one of {', '.join(choices)}")
    return d


def _nonce(h: dict, what: str) -> bytes:
    nonce = _bytes(h, "nonce", what, 64)
    if len(nonce) < 16:
        raise FrameError(f"{what}: nonce is too short")
    return nonce


MESSAGES: dict[MessageType, type["Message"]] = {}


def message(type: MessageType):
    """Register a message class as the header of frames of `type`."""

    def register(cls):
        cls.TYPE = type
        MESSAGES[type] = cls
        return cls

    return register


class Message:
    TYPE: ClassVar[MessageType]

    def to_wire(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, h: dict) -> "Message":
        return cls()


def parse_message(frame: Frame) -> Message:
    return MESSAGES[frame.type].parse(frame.header)


# -- handshake ---------------------------------------------------------------------------


@message(MessageType.HELLO)
@dataclass
class Hello(Message):
    role: str  # "coordinator" | "peer"
    nonce: bytes

    @classmethod
    def parse(cls, h: dict) -> "Hello":
        nonce = _nonce(h, "HELLO")
        return cls(_str(h, "role", "HELLO", choices={"coordinator", "peer"}), nonce)


@message(MessageType.CHALLENGE)
@dataclass
class Challenge(Message):
    nonce: bytes
    worker_id: str
    auth: bool  # whether the worker requires a token

    @classmethod
    def parse(cls, h: dict) -> "Challenge":
        nonce = _nonce(h, "CHALLENGE")
        return cls(nonce, _str(h, "worker_id", "CHALLENGE", 256), _get(h, "auth", bool, "CHALLENGE"))


@dataclass
class _Proof(Message):
    proof: bytes  # an HMAC over both nonces proving the sender knows the token; empty without one

    @classmethod
    def parse(cls, h: dict) -> "_Proof":
        return cls(_bytes(h, "proof", cls.TYPE.name))


@message(MessageType.AUTH)
class Auth(_Proof):
    """The client's proof, sent first."""


@message(MessageType.WELCOME)
class Welcome(_Proof):
    """The worker's proof; the handshake is done."""


@message(MessageType.ERROR)
@dataclass
class Error(Message):
    code: str
    message: str

    def __post_init__(self):
        self.message = self.message[:4000]

    @classmethod
    def parse(cls, h: dict) -> "Error":
        return cls(_str(h, "code", "ERROR", 64), _str(h, "message", "ERROR", 4096))


# -- liveness and control ------------------------------------------------------------------


@dataclass
class _Clock(Message):
    t: float = 0.0  # the pinging side's clock, echoed back

    @classmethod
    def parse(cls, h: dict) -> "_Clock":
        return cls(_get(h, "t", float, cls.TYPE.name) if "t" in h else 0.0)


@message(MessageType.PING)
class Ping(_Clock):
    pass


@message(MessageType.PONG)
@dataclass
class Pong(_Clock):
    # [stage index, milliseconds]: each stage this worker runs, the moving average of its compute
    # time in a decode step (for the coordinator's status); empty while none has run one
    stages: list[list] = field(default_factory=list)

    @classmethod
    def parse(cls, h: dict) -> "Pong":
        stages = _list(h, "stages", "PONG", MAX_ROWS) if "stages" in h else []
        if not all(
            isinstance(s, list)
            and len(s) == 2
            and isinstance(s[0], int)
            and not isinstance(s[0], bool)
            and 0 <= s[0] < MAX_ROWS
            and isinstance(s[1], (int, float))
            and not isinstance(s[1], bool)
            and math.isfinite(s[1])
            and s[1] >= 0
            for s in stages
        ):
            raise FrameError("PONG: stages must be [index, milliseconds] pairs")
        return cls(_get(h, "t", float, "PONG") if "t" in h else 0.0, stages)


@message(MessageType.DESCRIBE)
@dataclass
class Describe(Message):
    """Asks for DEVICES."""


@message(MessageType.RELEASE)
@dataclass
class Release(Message):
    """Drop the plan and its memory; answered by OK."""


@message(MessageType.OK)
@dataclass
class Ok(Message):
    pass


@message(MessageType.FREE)
@dataclass
class Free(Message):
    slot: int  # a sequence slot no longer used

    @classmethod
    def parse(cls, h: dict) -> "Free":
        return cls(_int(h, "slot", "FREE", 0, 4095))


# -- devices and plans -------------------------------------------------------------------


@dataclass
class DeviceInfo:
    name: str
    free: int
    total: int
    dtype: str  # the compute dtype the worker's own hardware does best
    kernels: bool  # whether PyTorch's packed int4/int8 kernels run on it
    fastest: dict[str, str]  # stored type -> the format that decodes fastest there, as measured
    # stored type -> whose product multiplies a prompt chunk there ("shardwire" or "ggml"), as measured
    products: dict[str, str] = field(default_factory=dict)
    row_products: dict[str, str] = field(default_factory=dict)  # the same for one row
    compute: str = ""  # the kernels that compute on it, in words ("ggml 0.9.4 ... AVX-512 VNNI")

    @classmethod
    def parse(cls, d, what: str = "DEVICES") -> "DeviceInfo":
        d = _map(d, what)
        return cls(
            _str(d, "name", what, 64),
            _int(d, "free", what),
            _int(d, "total", what),
            _str(d, "dtype", what, 16, COMPUTE_DTYPES),
            _get(d, "kernels", bool, what),
            _formats(d, "fastest", what),
            _formats(d, "products", what, PRODUCT_SOURCES) if "products" in d else {},  # absent: none measured
            _formats(d, "row_products", what, PRODUCT_SOURCES) if "row_products" in d else {},
            _str(d, "compute", what, 256) if "compute" in d else "",
        )


@message(MessageType.DEVICES)
@dataclass
class Devices(Message):
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
        file = _str(d, "file", what, 255)
        if "/" in file or "\\" in file or file in ("", ".", ".."):
            raise FrameError(f"{what}: file must be a plain base name")
        return cls(
            _str(d, "name", what, 128),
            _str(d, "dtype", what, 8, STORED_TYPES),
            shape,
            _int(d, "nbytes", what, 1, 1 << 40),
            _hash(d, "hash", what),
            file,
            _int(d, "file_size", what),
            _int(d, "offset", what),
        )


@dataclass
class OverrideSpec:
    """-ot: the block matrices `pattern` matches live on `device` of this worker, computing in
    `dtype` with that device's measured `fastest` formats, instead of on their stage's device."""

    pattern: str
    device: str
    dtype: str
    fastest: dict[str, str]

    @classmethod
    def parse(cls, d) -> "OverrideSpec":
        d, what = _map(d, "ASSIGN override"), "ASSIGN override"
        return cls(
            _str(d, "pattern", what, 1024),
            _str(d, "device", what, 32),
            _str(d, "dtype", what, 16, COMPUTE_DTYPES),
            _formats(d, "fastest", what),
        )


@dataclass
class StageSpec:
    index: int
    device: str
    start: int
    end: int
    first: bool
    last: bool
    dtype: str
    weights: str  # how quantized weights live on the device: fast | dequant | packed | compact
    fastest: dict[str, str]  # the device's measured fastest formats, as the plan used them
    tensors: list[TensorSpec]
    overrides: list[OverrideSpec]

    @classmethod
    def parse(cls, d) -> "StageSpec":
        d, what = _map(d, "ASSIGN stage"), "ASSIGN stage"
        # a mixture of experts holds a matrix per expert: 128 experts x 3 x 94 blocks and more
        tensors = [TensorSpec.parse(t) for t in _list(d, "tensors", what, 1 << 20)]
        stage = cls(
            _int(d, "index", what, 0, 1 << 16),
            _str(d, "device", what, 32),
            _int(d, "start", what, 0, 1 << 16),
            _int(d, "end", what, 0, 1 << 16),
            _get(d, "first", bool, what),
            _get(d, "last", bool, what),
            _str(d, "dtype", what, 16, COMPUTE_DTYPES),
            _str(d, "weights", what, 16, STAGE_WEIGHT_MODES),
            _formats(d, "fastest", what),
            tensors,
            [OverrideSpec.parse(o) for o in _list(d, "overrides", what, 64)],
        )
        for o in stage.overrides:
            try:
                re.compile(o.pattern)
            except re.error:
                raise FrameError(f"{what}: override pattern {o.pattern!r} is not a regular expression") from None
        if stage.start > stage.end:
            raise FrameError(f"{what}: start {stage.start} > end {stage.end}")
        return stage


@dataclass
class NextHop:
    """The worker holding the following stage, and its TLS certificate as the coordinator verified it."""

    host: str
    port: int
    fingerprint: str | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @classmethod
    def parse(cls, d) -> "NextHop":
        d, what = _map(d, "ASSIGN next"), "ASSIGN next"
        fp = None
        if d.get("fingerprint") is not None:
            fp = _str(d, "fingerprint", what, 71)
            if not fp.startswith("sha256:") or len(fp) != 71:
                raise FrameError(f"{what}: fingerprint is not sha256:<64 hex>")
        return cls(_str(d, "host", what, 255), _int(d, "port", what, 1, 65535), fp)


@message(MessageType.ASSIGN)
@dataclass
class Assign(Message):
    plan: str
    coordinator: str  # which coordinator sent it: the same one may take its plan over
    config: dict
    qk_interleaved: bool
    n_slots: int
    ctx: int
    prefill_chunk: int  # the most tokens per row of a step: the stages' workspace follows it
    kv_pages: int  # pages in each stage's KV pool: page ids in FORWARD stay below it
    stages: list[StageSpec]
    next: NextHop | None  # None after the last stage
    window_step: int = 0  # blocks on a sliding window keep a ring per slot for steps this long (0: every position)

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
        return cls(
            _str(h, "plan", what, 64),
            _str(h, "coordinator", what, 64),
            _map(_get(h, "config", dict, what), what),
            _get(h, "qk_interleaved", bool, what),
            _int(h, "n_slots", what, 1, 4096),
            _int(h, "ctx", what, 1, 1 << 24),
            _int(h, "prefill_chunk", what, 1, 1 << 20),
            _int(h, "kv_pages", what, 1, 1 << 24),
            stages,
            None if nxt is None else NextHop.parse(nxt),
            _int(h, "window_step", what, 0, 1 << 20),
        )


@message(MessageType.NEED)
@dataclass
class Need(Message):
    hashes: list[str]  # the tensors the worker found neither in its own file nor its cache

    @classmethod
    def parse(cls, h: dict) -> "Need":
        hashes = _list(h, "hashes", "NEED", 1 << 16)
        if not all(isinstance(x, str) and len(x) == HASH_LEN for x in hashes):
            raise FrameError("NEED: bad hash")
        return cls(hashes)


@message(MessageType.WEIGHTS)
@dataclass
class Weights(Message):
    """One chunk of one tensor's bytes; the payload is the chunk."""

    hash: str
    offset: int
    total: int

    @classmethod
    def parse(cls, h: dict) -> "Weights":
        what = "WEIGHTS"
        return cls(_hash(h, "hash", what), _int(h, "offset", what, 0, 1 << 40), _int(h, "total", what, 1, 1 << 40))


@dataclass
class StageReport:
    index: int
    weight_bytes: int
    kv_bytes: int
    choices: list[str] = field(default_factory=list)  # what the stage's start measured and chose (Stage.choices)

    @classmethod
    def parse(cls, d) -> "StageReport":
        d, what = _map(d, "READY stage"), "READY stage"
        choices = _list(d, "choices", what, 8)
        if not all(isinstance(c, str) and len(c) <= 400 for c in choices):
            raise FrameError(f"{what}: choices must be lines of at most 400 characters")
        return cls(
            _int(d, "index", what, 0, 1 << 16), _int(d, "weight_bytes", what), _int(d, "kv_bytes", what), choices
        )


@message(MessageType.READY)
@dataclass
class Ready(Message):
    stages: list[StageReport]
    sources: dict[str, int] = field(default_factory=dict)  # weight bytes by where they came from

    @classmethod
    def parse(cls, h: dict) -> "Ready":
        sources = _map(_get(h, "sources", dict, "READY"), "READY")
        if set(sources) - set(SOURCE_KINDS):
            raise FrameError(f"READY: sources must be among {', '.join(SOURCE_KINDS)}")
        return cls(
            [StageReport.parse(s) for s in _list(h, "stages", "READY", 64)],
            {k: _int(sources, k, "READY sources") for k in sources},
        )


# -- the data path -----------------------------------------------------------------------


@message(MessageType.FORWARD)
@dataclass
class Forward(Message):
    """One step for a batch of rows; the payload is int32 token ids (into the first stage) or
    hidden states (between stages)."""

    plan: str
    step: int
    rows: list[tuple[int, int, int]]  # (slot, start position, new tokens)
    pages: list[list[int]]  # per row: the KV pages of positions [0, start + new tokens), in order
    sampling: list[dict | None]  # per row; None = fill the cache only
    recent: list[list[int]]  # per row: tokens for repetition penalties
    dtype: str  # payload: "int32" token ids, or hidden states
    shape: list[int]  # [rows, tokens per row] for ids, [rows, tokens per row, dim] for hidden
    constraints: list[dict | None] | None = None  # per row, a RowConstraint's dict; None: no row has one
    # per row, the proposed tokens its last positions carry, for the sampling stage to check
    # (pipeline.Row.n_draft); None: no row has any
    drafts: list[list[int]] | None = None

    @classmethod
    def parse(cls, h: dict) -> "Forward":
        what = "FORWARD"
        rows = _list(h, "rows", what, MAX_ROWS)
        if not rows:
            raise FrameError(f"{what}: no rows")
        parsed = []
        for r in rows:
            if (
                not isinstance(r, list)
                or len(r) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in r)
            ):
                raise FrameError(f"{what}: a row must be [slot, start, n] of non-negative ints")
            parsed.append(tuple(r))
        widths = {r[2] for r in parsed}
        if len(widths) != 1 or 0 in widths:
            raise FrameError(f"{what}: rows must all carry the same positive number of tokens")
        pages = _list(h, "pages", what, MAX_ROWS)
        if len(pages) != len(parsed):
            raise FrameError(f"{what}: pages must have one table per row")
        for table, (_, start, n) in zip(pages, parsed):
            if (
                not isinstance(table, list)
                or len(table) != pages_for(start + n)
                or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in table)
            ):
                raise FrameError(f"{what}: a row's pages must be the {pages_for(start + n)} page ids of its positions")
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
        dtype = _str(h, "dtype", what, 16, PAYLOAD_DTYPES)
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
        constraints = _per_row(h, "constraints", what, len(parsed))
        for c in constraints or []:
            try:
                c is None or RowConstraint.from_dict(c)
            except ValueError as e:
                raise FrameError(f"{what}: {e}") from None
        drafts = _per_row(h, "drafts", what, len(parsed))
        if drafts is not None:
            for draft in drafts:
                if (
                    not isinstance(draft, list)
                    or len(draft) >= n
                    or not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_VOCAB for x in draft)
                ):
                    raise FrameError(f"{what}: a row's drafts must be token ids, fewer than its {n} tokens")
        fields = (_str(h, "plan", what, 64), _int(h, "step", what), parsed, pages, sampling, recent, dtype, shape)
        return cls(*fields, constraints, drafts)

    @classmethod
    def of_rows(cls, plan: str, step: int, rows) -> "Forward":
        """The first stage's FORWARD for rows with .slot, .start, .tokens, .pages, .sampling, .recent,
        .constraint, .n_draft and .draft."""
        constraints = [r.constraint.to_dict() if r.constraint is not None else None for r in rows]
        return cls(
            plan,
            step,
            [(r.slot, r.start, len(r.tokens)) for r in rows],
            [list(r.pages) for r in rows],
            [r.sampling.to_dict() if r.sampling is not None else None for r in rows],
            [list(r.recent) for r in rows],
            "int32",
            [len(rows), len(rows[0].tokens)],
            constraints if any(c is not None for c in constraints) else None,
            [list(r.draft) for r in rows] if any(r.n_draft for r in rows) else None,
        )

    def row_constraints(self) -> list[RowConstraint | None]:
        return [None if c is None else RowConstraint.from_dict(c) for c in self.constraints or [None] * len(self.rows)]

    def passing_on(self, dtype: str, shape: list[int]) -> "Forward":
        """The same step, carrying hidden states of `dtype` and `shape` to the next stage."""
        # not dataclasses.replace, which takes about twice as long: this runs on every hop of every step
        fields = (self.plan, self.step, self.rows, self.pages, self.sampling, self.recent)
        return Forward(*fields, dtype, list(shape), self.constraints, self.drafts)

    def payload_nbytes(self) -> int:
        return PAYLOAD_DTYPES[self.dtype] * math.prod(self.shape)

    def to_wire(self) -> dict:
        out = {
            "plan": self.plan,
            "step": self.step,
            "rows": [list(r) for r in self.rows],
            "pages": self.pages,
            "sampling": self.sampling,
            "recent": self.recent,
            "dtype": self.dtype,
            "shape": self.shape,
        }
        if self.constraints is not None:
            out["constraints"] = self.constraints
        if self.drafts is not None:
            out["drafts"] = self.drafts
        return out


def _per_row(h: dict, name: str, what: str, rows: int) -> list | None:
    """An optional field with one entry per row."""
    if h.get(name) is None:
        return None
    value = _list(h, name, what, MAX_ROWS)
    if len(value) != rows:
        raise FrameError(f"{what}: {name} must have one entry per row")
    return value


@message(MessageType.VOCAB)
@dataclass
class Vocab(Message):
    """Coordinator -> the worker whose stage samples: what its grammar matchers match against. The
    payload is constrain.Vocabulary.to_payload(): n token lengths (uint32), then the tokens' bytes."""

    plan: str
    n: int  # tokens
    eos: list[int]  # the ids that end generation

    @classmethod
    def parse(cls, h: dict) -> "Vocab":
        what = "VOCAB"
        n = _int(h, "n", what, 1, MAX_VOCAB)
        eos = _list(h, "eos", what, 64)
        if not eos or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n for i in eos):
            raise FrameError(f"{what}: eos must be token ids of the vocabulary")
        return cls(_str(h, "plan", what, 64), n, eos)


@message(MessageType.RESULT)
@dataclass
class Result(Message):
    step: int
    tokens: list[list[int]]  # per row, what it sampled in order; [] for a row that only filled the cache
    logprobs: list[list | None]  # per row: None, or per token [chosen logprob, [[id, logprob], ...]]

    @classmethod
    def parse(cls, h: dict) -> "Result":
        tokens = _list(h, "tokens", "RESULT", MAX_ROWS)
        logprobs = _list(h, "logprobs", "RESULT", MAX_ROWS)
        if len(logprobs) != len(tokens) or not all(
            isinstance(row, list)
            and len(row) <= MAX_TOKENS_PER_STEP
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)
            for row in tokens
        ):
            raise FrameError("RESULT: bad tokens")
        for row, lps in zip(tokens, logprobs):
            if lps is not None and not (isinstance(lps, list) and len(lps) == len(row) and all(map(_logprob, lps))):
                raise FrameError("RESULT: bad logprobs")
        return cls(_int(h, "step", "RESULT"), tokens, logprobs)

    @classmethod
    def of_sampled(cls, step: int, sampled: list[list[Sampled]]) -> "Result":
        return cls(
            step,
            [[s.token for s in row] for row in sampled],
            [
                [[s.logprob, [list(t) for t in s.top]] for s in row] if row and row[0].logprob is not None else None
                for row in sampled
            ],
        )

    def sampled(self) -> list[list[Sampled]]:
        return [
            [Sampled(t) for t in row]
            if lps is None
            else [Sampled(t, lp[0], [tuple(x) for x in lp[1]]) for t, lp in zip(row, lps)]
            for row, lps in zip(self.tokens, self.logprobs)
        ]


def _logprob(lp) -> bool:
    """Whether lp is [chosen logprob, [[id, logprob], ...]]."""
    return (
        isinstance(lp, list)
        and len(lp) == 2
        and isinstance(lp[0], (int, float))
        and isinstance(lp[1], list)
        and all(isinstance(t, list) and len(t) == 2 for t in lp[1])
    )
