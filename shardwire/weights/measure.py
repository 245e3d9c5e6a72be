"""Which format multiplies one row of activations fastest on this machine, for each stored type:
measured once per CPU model, compute dtype, thread count and library versions, and kept on disk.

Decode reads every weight once per token, so the format that streams a matrix fastest decides
decode speed; which one that is differs by CPU (PyTorch's bf16 matrix-vector product is fast on
one and slow on another), so it is timed, never inferred from a CPU vendor or feature flag.
The candidates: the dense matrix in the compute dtype, PyTorch's packed kernel for the type,
ggml's kernel on the stored blocks, and ggml's on its repacked layout where it has one here.
The formats are timed on zero blocks: on a model's weights they chose alike (an AMD EPYC with
AVX-512; the candidates 1.15x or more apart).

Where shardwire's ggml (kernels/) has shardwire's own products (kernels/products.cpp) of a prompt chunk
or of one row, each is timed on those rows against the ggml kernel it stands in for, on weights
like a model's (the speed of ggml's products of one row depends on them), and only the faster runs
(own_products), before the formats are timed.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import platform
import statistics
import time
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..devices import TORCH_DTYPES, large_allocations_unmapped
from ..enums import PRODUCT_SOURCES, QUANT_TYPES, STORED_TYPES, WEIGHT_FORMATS
from ..linear import Linear
from . import ggml_cpu, load
from .codecs import stored_nbytes
from .kernels import kernels_on
from .packed import pack_plain
from .policy import FAST, PRODUCT_FORMATS

log = logging.getLogger("shardwire.measure")

MEASURED_TYPES = QUANT_TYPES + ("F16", "BF16", "F32")
SHAPE = (4096, 2048)  # [out, in]: a 1B-class projection, larger than most CPUs' L2
SECONDS = 0.01  # per candidate and turn, at least 3 runs
PROMPT_ROWS = 64
# Prompt tokens a request reads per token it generates, for weighing a format's prompt speed
# against its decode speed: a chat turn reads its context (~1000 tokens) to write ~250. Where one
# format decodes faster and another reads prompts faster (ggml's repacked Q4_K and its tiled
# products on the stored blocks), the one that serves such a request sooner is taken.
PROMPT_PER_GENERATED = 4
NEAR = 1.5  # candidates decoding within this factor of the fastest are timed on a prompt chunk too
DEQUANTIZED = "ggml, dequantized into a GEMM"  # how ggml's stored-block layer may take a prompt chunk


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _key(dtype: str) -> str:
    versions = f"torch {torch.__version__}, ggml {ggml_cpu.build() or 'no'}"
    turns = f"fastest of {ROUNDS} turns ({ROUNDS + CLOSE_ROUNDS} within {CLOSE}x)"
    method = f"{turns}, decode + {PROMPT_PER_GENERATED} prompt rows of every near format"
    return f"{cpu_model()} | {dtype} | {torch.get_num_threads()} thread(s) | {versions} | {method}"


def last_level_cache_bytes() -> int:
    """The largest CPU cache, as sysfs lists it (64 MiB where it does not)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip().upper()
            sizes.append(int(text.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(text[-1], 0))
        except (OSError, ValueError):
            pass
    return max(sizes, default=64 << 20)


@lru_cache(maxsize=None)
def _eviction_buffer() -> torch.Tensor:
    return torch.zeros(2 * last_level_cache_bytes(), dtype=torch.uint8)


def _seconds(call) -> float:
    """Fastest seconds of `call` with the caches emptied before each run, as when a model much
    larger than the caches streams its weights (a matrix that stays cached would time the cache).
    The fastest, not the median: other work on the machine only ever adds time, and the
    candidates are timed in turns (ROUNDS) so that a busy moment does not decide for one."""
    call()
    evict, times, start = _eviction_buffer(), [], time.perf_counter()
    while time.perf_counter() - start < SECONDS or len(times) < 3:
        evict.add_(1)
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return min(times)


ROUNDS = 3
# Formats this close to the fastest on one row (repacked and stored Q4_K on the EPYC) get CLOSE_ROUNDS
# more turns: one busy moment over 3 turns once chose the one that decodes 15% slower, for good
# (the choice is kept).
CLOSE, CLOSE_ROUNDS = 1.1, 6


def _fastest_of(calls: dict, rounds: int = ROUNDS) -> dict[str, float]:
    """Each call's fastest seconds over `rounds` turns through all of them."""
    best = {name: float("inf") for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], _seconds(call))
    return best


def _settled(calls: dict) -> dict[str, float]:
    """Each call's fastest seconds over ROUNDS turns, and CLOSE_ROUNDS more for those within CLOSE
    of the fastest."""
    times = _fastest_of(calls)
    close = [name for name, t in times.items() if t <= CLOSE * min(times.values())]
    if len(close) > 1:
        again = _fastest_of({name: calls[name] for name in close}, CLOSE_ROUNDS)
        times.update({name: min(times[name], again[name]) for name in close})
    return times


def _candidates(stored: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    raw = torch.zeros(SHAPE[0], stored_nbytes(stored, SHAPE) // SHAPE[0], dtype=torch.uint8)
    out = {"dense": Linear(torch.zeros(SHAPE, dtype=dtype))}
    if stored in FAST and kernels_on("cpu"):
        out[FAST[stored]] = pack_plain(raw, stored, FAST[stored], "cpu", dtype)
    if ggml_cpu.available():
        out["ggml"] = ggml_cpu.GGMLLinear(raw, stored, SHAPE[1], dtype)
    try:
        out["repacked"] = ggml_cpu.RepackedLinear(raw, stored, SHAPE[1], dtype)
    except ggml_cpu.RepackError:  # no repacked layout for the type here (or no ggml)
        pass
    return out


def _prompt_takers(candidates: dict, near: list[str]) -> list[tuple[str, torch.nn.Module]]:
    """The modules that may take a prompt chunk for the `near` candidates: ggml's stored-block
    layer takes it through its kernel or dequantized into a GEMM, from the rows where that is faster."""
    out = [(fmt, candidates[fmt]) for fmt in near]
    if "ggml" in near:
        g = candidates["ggml"]
        out.append((DEQUANTIZED, ggml_cpu.GGMLLinear(g.raw, g.stored, g.in_features, g.compute_dtype, 0)))
    return out


def _rows(module: torch.nn.Module, n: int, dtype: torch.dtype):
    x = torch.zeros(n, SHAPE[1], dtype=dtype)
    return lambda: module(x)


def request_seconds(one_row: float, chunk: float) -> float:
    """A format's time for a generated token and the PROMPT_PER_GENERATED prompt tokens read with
    it, from its seconds for one row and for a PROMPT_ROWS-row chunk."""
    return one_row + PROMPT_PER_GENERATED * chunk / PROMPT_ROWS


def measure(dtype: str) -> dict[str, dict]:
    """For each stored type: every candidate's seconds for one row and the fastest. Where others
    decode within NEAR of the fastest one row, each of them is timed on a prompt chunk
    (PROMPT_ROWS rows) too, and the one with the least request_seconds is the fastest: a kernel
    made for one row (PyTorch's int4 on some CPUs) may decode a hair faster and read a prompt
    several times slower."""
    torch_dtype = TORCH_DTYPES[dtype]
    out = {}
    for stored in MEASURED_TYPES:
        candidates = _candidates(stored, torch_dtype)
        one_row = {fmt: _rows(m, 1, torch_dtype) for fmt, m in candidates.items()}
        times = _settled(one_row)
        fastest = min(times, key=times.get)
        near = [f for f, t in times.items() if t <= NEAR * times[fastest]]
        entry = {"seconds": times, "fastest": fastest}
        if len(near) > 1:
            takers = _prompt_takers(candidates, near)
            chunk = _fastest_of({fmt: _rows(m, PROMPT_ROWS, torch_dtype) for fmt, m in takers})
            if DEQUANTIZED in chunk:  # ggml's layer takes a chunk whichever way it measured faster (gemm_rows)
                chunk["ggml"] = min(chunk["ggml"], chunk.pop(DEQUANTIZED))
            entry.update(
                prompt_seconds=chunk, fastest=min(near, key=lambda fmt: request_seconds(times[fmt], chunk[fmt]))
            )
        out[stored] = entry
    return out


def _cache_file() -> Path:
    from .cache import default_cache_dir

    return default_cache_dir() / "kernels.json"


def _kept() -> dict:
    try:
        known = json.loads(_cache_file().read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def _keep(known: dict) -> None:
    path = _cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)


def _usable(entry, valid) -> bool:
    return (
        isinstance(entry, dict)
        and isinstance(entry.get("provisional"), bool)
        and isinstance(entry.get("when"), str)
        and isinstance(entry.get("load"), str)
        and valid(entry.get("result"))
    )


_used: dict[str, dict] = {}  # key -> the entry this process took its choices from (provenance)


@contextmanager
def _one_measuring():
    """Held while this process decides whether to measure and measures: the processes sharing a
    cache file (the workers a machine starts at once) measure one at a time, the others waiting
    idle, so none is timed under another's measurement, and each reads what the first kept."""
    path = _cache_file().with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path, "a")
    except OSError:  # a cache that cannot be written: each measures on its own
        yield
        return
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _remembered(key: str, compute, valid=lambda result: True) -> dict:
    """compute()'s result as kept in the cache file under `key`, computed and kept there when
    missing, not `valid` (a file edited by hand or by another version: what it says travels to
    coordinators, which refuse what they cannot read), or provisional (taken while the machine was
    busy) and the machine is quiet now. Each is kept with when it was taken and under what load."""
    with _one_measuring():
        return _remembered_now(key, compute, valid)


def _remembered_now(key: str, compute, valid) -> dict:
    path, known = _cache_file(), _kept()
    entry = known.get(key)
    if entry is not None and not _usable(entry, valid):
        log.warning("%s: the entry for %r is not one this version wrote; measuring again", path, key)
        entry = None
    if entry is not None and entry["provisional"] and not load.now().busy:
        log.info("%s: the entry for %r was measured %s; measuring again", path, key, entry["load"])
        entry = None
    if entry is None:
        # every matrix timed is mapped afresh and returned when freed, as when stages are built:
        # glibc's heap kept some of them resident under the model loaded next (9 MiB of a 1B Q4_0
        # process's peak the first time on a machine)
        large_allocations_unmapped()
        try:
            with load.Watch() as watch:
                result = compute()
        finally:  # up to twice the largest cache (960 MiB where a VM lists its host's): not kept
            _eviction_buffer.cache_clear()
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        entry = {"result": result, "when": when, "load": watch.load.words(), "provisional": watch.load.busy}
        known = _kept()  # as another process may have left it meanwhile
        known[key] = entry
        _keep(known)
    _used[key] = entry
    return entry["result"]


def forget_measurements() -> int:
    """Drop what the cache file keeps for this CPU model, so that it is measured again; how many."""
    known = _kept()
    mine = [key for key in known if key.startswith(f"{cpu_model()} |")]
    for key in mine:
        del known[key]
    _keep(known)
    for stale in (fastest_formats, own_products, gemm_rows):
        stale.cache_clear()
    return len(mine)


def provenance(device: str, dtype: str) -> str | None:
    """When and under what load the kernel choices for `device` and `dtype` in use here were
    measured, in a line; None where nothing was measured (not a CPU)."""
    entries = [e for key, e in _used.items() if key.startswith(_key(dtype))]
    if not device.startswith("cpu") or not entries:
        return None
    formats = _used.get(_key(dtype), {}).get("result", {})
    chosen = " ".join(f"{stored}:{entry['fastest']}" for stored, entry in formats.items())
    latest = max(entries, key=lambda e: e["when"])
    provisional = [e for e in entries if e["provisional"]]
    if provisional:
        return (
            f"kernel choices ({chosen}) measured {provisional[0]['when']} {provisional[0]['load']}: provisional, "
            "measured again at the next start on a quiet machine (or now: shardwire worker --remeasure)"
        )
    return f"kernel choices ({chosen}) measured {latest['when']}, {latest['load']}"


def _chooses(measured, choices) -> bool:
    """Whether `measured` maps stored types to entries whose "fastest" is one of `choices`."""
    return isinstance(measured, dict) and all(
        stored in STORED_TYPES and isinstance(entry, dict) and entry.get("fastest") in choices
        for stored, entry in measured.items()
    )


@lru_cache(maxsize=None)
def fastest_formats(device: str, dtype: str) -> dict[str, str]:
    """Stored type -> the format that decodes fastest on `device` computing in `dtype`. Measured on
    CPUs (a few seconds the first time on a machine, then read from the cache), with the products
    own_products chose; other devices have no measurement and get {}: the policy's
    defaults apply there."""
    if not device.startswith("cpu"):
        return {}
    prompt_products(device, dtype)
    row_products(device, dtype)
    measured = _remembered(
        _key(dtype),
        lambda: measure(dtype),
        lambda m: _chooses(m, WEIGHT_FORMATS) and set(MEASURED_TYPES) <= set(m),  # an older version's lacks types
    )
    return {stored: entry["fastest"] for stored, entry in measured.items()}


# types ggml quantizes only against an importance matrix (5 s for a SHAPE matrix), which
# model_like fills with random codes
RANDOM_CODES = ("IQ2_XXS", "IQ3_XXS")


def model_like(stored: str, shape: tuple[int, int] | None = None) -> torch.Tensor:
    """A matrix (SHAPE unless `shape`) of `stored` blocks holding what a model's weights hold
    (normal values of a trained layer's spread, quantized by ggml), for the products whose speed
    depends on them: on zero blocks ggml's Q8_0 product of one row streamed as fast as shardwire's,
    on a model's 1.26x slower (an AMD EPYC with AVX-512, both reading the 1B layout's Q8_0 file).
    RANDOM_CODES types hold random codes under a trained layer's F16 scales (each block's first 2
    bytes): their products read every code through the same tables."""
    shape, generator = shape or SHAPE, torch.Generator().manual_seed(0)
    if stored in RANDOM_CODES:
        rows, row_bytes = shape[0], stored_nbytes(stored, shape) // shape[0]
        raw = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=generator)
        blocks = raw.view(rows, -1, stored_nbytes(stored, (1, 256)))
        blocks[..., :2] = torch.tensor([0.002], dtype=torch.float16).view(torch.uint8)  # each block's scale
        return raw
    return ggml_cpu.quantized(torch.randn(shape, generator=generator) * 0.02, stored)


PRODUCT_ROWS = {"gemm": PROMPT_ROWS, "gemv": 1}  # the rows a product of each kind (ggml_cpu.OWN_PRODUCTS) is timed on


def streamed_bytes() -> int:
    """Bytes of weights a one-row product is timed on: four times the largest cache, as a decode step
    streams a stage's weights from memory. At twice (64 MiB on an AMD EPYC with 32 MiB of L3) the
    two kernels for Q4_0 came out 1.01x-1.19x apart from run to run; from four times on, 1.17x-1.34x,
    as on the 1B layout's own weights (1.19x)."""
    return min(max(128 << 20, 4 * last_level_cache_bytes()), 1 << 30)


# Passes a one-row product is timed in, each on matrices of its own: its seconds are the median of
# their fastest. Streaming from memory, the two kernels are within 5-20% of each other, and a
# worker's start during a test run once chose the other one for two types, each more than 10%
# apart (an AMD EPYC with AVX-512; every other pass that day, in 14 processes, chose alike).
ROW_PASSES = 3


def _own_products(kind: str, dtype: torch.dtype) -> dict[str, dict]:
    """For each stored type this ggml has one of shardwire's own products of `kind` for: its
    PRODUCT_ROWS rows' seconds through it and through ggml's kernel, and the faster. A prompt
    chunk's are the fastest of turns, more for kernels close to each other (_settled); one row's
    the median over ROW_PASSES passes of the fastest of ROUNDS turns each."""
    if PRODUCT_ROWS[kind] > 1:
        passes = [_product_seconds(kind, dtype, _settled)]
    else:
        passes = [_product_seconds(kind, dtype, _fastest_of) for _ in range(ROW_PASSES)]
    out = {}
    for stored in passes[0]:
        times = {whose: statistics.median(p[stored][whose] for p in passes) for whose in passes[0][stored]}
        out[stored] = {"seconds": times, "fastest": min(times, key=times.get)}
    return out


def _product_seconds(kind: str, dtype: torch.dtype, timed) -> dict[str, dict[str, float]]:
    """For each stored type this ggml has one of shardwire's own products of `kind` for: its
    PRODUCT_ROWS rows' fastest seconds through it and through ggml's kernel, timed in turns. One
    row goes through streamed_bytes() of matrices, one after another, as a decode step streams its
    weights: how fast one product starts on a matrix fresh from memory varies by half from run
    to run, and a step's speed is in the streaming. `timed`: how the two are timed in turns."""
    out = {}
    try:
        for stored in ggml_cpu.own_products(kind):
            count = -(-streamed_bytes() // stored_nbytes(stored, SHAPE)) if PRODUCT_ROWS[kind] == 1 else 1
            weights = model_like(stored)
            held = ggml_cpu.RepackedLinear if PRODUCT_FORMATS[stored] == "repacked" else ggml_cpu.GGMLLinear
            try:  # a repacked matrix is a copy: each clone is dropped once copied
                modules = [held(weights.clone(), stored, SHAPE[1], dtype) for _ in range(count)]
            except ggml_cpu.RepackError:  # the product reads a layout this CPU does not repack into
                continue
            x = torch.randn(PRODUCT_ROWS[kind], SHAPE[1], generator=torch.Generator().manual_seed(0)).to(dtype)

            def rows(modules=modules, x=x):
                for module in modules:
                    module(x)

            def through(types, rows=rows):
                def call():
                    ggml_cpu.use_own_products(types, kind)
                    rows()

                return call

            out[stored] = timed({"shardwire": through([stored]), "ggml": through([])})
    finally:
        ggml_cpu.use_own_products(ggml_cpu.own_products(kind), kind)
    return out


@lru_cache(maxsize=None)
def own_products(device: str, dtype: str, kind: str) -> dict[str, str]:
    """Stored type -> whose product of `kind` (ggml_cpu.OWN_PRODUCTS) multiplies its weights on
    `device`: "shardwire" (its own, kernels/products.cpp) or "ggml" (the kernel it stands in for),
    for the types this ggml has an own product of that kind for: measured on CPUs (then read from
    the cache), and switched so in this process. {} on other devices and without own products."""
    if not device.startswith("cpu") or not ggml_cpu.own_products(kind):
        return {}
    rows = PRODUCT_ROWS[kind]
    # a build with other products measures again, as does a process that measures one row otherwise
    measured = _remembered(
        f"{_key(dtype)} | {f'prompt products of {rows} rows' if rows > 1 else 'one-row products'}: "
        f"{','.join(ggml_cpu.own_products(kind))} (model-like weights, v{3 if rows == 1 else 2})",
        lambda: _own_products(kind, TORCH_DTYPES[dtype]),
        lambda m: _chooses(m, PRODUCT_SOURCES) and set(m) <= set(ggml_cpu.own_products(kind)),
    )
    chosen = {stored: entry["fastest"] for stored, entry in measured.items()}
    ggml_cpu.use_own_products([stored for stored, whose in chosen.items() if whose == "shardwire"], kind)
    return chosen


def prompt_products(device: str, dtype: str) -> dict[str, str]:
    """own_products of a prompt chunk."""
    return own_products(device, dtype, "gemm")


def row_products(device: str, dtype: str) -> dict[str, str]:
    """own_products of one row: a decode step of one sequence."""
    return own_products(device, dtype, "gemv")


GEMM_ROWS = (16, 64, 256)  # the row counts at which ggml and dequantize-then-GEMM are compared


def _gemm_rows(stored: str, dtype: torch.dtype) -> dict:
    shape = (SHAPE[0] // 2, SHAPE[1])
    raw = torch.zeros(shape[0], stored_nbytes(stored, shape) // shape[0], dtype=torch.uint8)
    modules = {
        way: ggml_cpu.GGMLLinear(raw, stored, shape[1], dtype, rows) for way, rows in (("ggml", None), ("gemm", 0))
    }
    times = {}
    for n in GEMM_ROWS:
        x = torch.zeros(n, shape[1], dtype=dtype)
        times[n] = _fastest_of({way: (lambda m=m: m(x)) for way, m in modules.items()})
    rows = next((n for n in GEMM_ROWS if times[n]["gemm"] < times[n]["ggml"]), None)
    return {"seconds": times, "rows": rows}


@lru_cache(maxsize=None)
def gemm_rows(stored: str, dtype: torch.dtype) -> int | None:
    """From how many rows of activations a matrix of `stored` on ggml is faster dequantized a chunk
    at a time into a GEMM in `dtype` (ggml's kernels on blocks that are not repacked are made for
    few rows); None: never, up to the largest count measured. Measured on first use per stored
    type, then read from the cache."""
    name = str(dtype).removeprefix("torch.")
    return _remembered(
        f"{_key(name)} | gemm rows {stored} (ggml dequantizes into scratch, v3)",
        lambda: _gemm_rows(stored, dtype),
        lambda e: isinstance(e, dict) and e.get("rows") in (None, *GEMM_ROWS),
    )["rows"]
