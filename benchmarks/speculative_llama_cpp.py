"""llama.cpp's speculative decoding on the files benchmarks/speculative.py runs, over the same
emulated links: ggml-rpc-server workers behind relays, llama-server with --rpc as the
coordinator, once plain, once with --spec-type ngram-simple, once with the draft model (-md).
Each request sends the prompt's token ids to /completion and reads the decode speed and the
proposals llama-server counted from its `timings`.

Used by benchmarks/speculative.py (its --llama-cpp runs); not a command of its own.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

import numpy as np

from shardwire.formats import open_model
from shardwire.formats.tensors import TensorReader

from .relay import Relay
from .run import Server, free_port

_DTYPES = {"F32": np.float32, "F16": np.float16}


def gguf_of(folder: Path) -> Path:
    """A glassllm-vocabulary Hugging Face folder (the taught model, the distilled draft) as a GGUF
    file llama.cpp reads, written by shardwire's writer (llama.cpp's converter does not read
    glassllm's tokenizer); cached beside it."""
    from shardwire_kit import glassllm
    from shardwire_kit.writer import write_gguf

    out = folder.with_name(folder.name + ".gguf")
    if out.exists():
        return out
    model, reader = open_model(folder), TensorReader()
    tensors = {}
    for name, info in model.tensors.items():
        raw = np.frombuffer(reader.read(info).tobytes(), dtype=_DTYPES[info.dtype])
        tensors[name] = raw.reshape(info.shape).astype(np.float32)
    _, tok = glassllm.load("en")
    metadata = glassllm.gguf_tokenizer_metadata(tok, glassllm.tokenizer_json(tok))
    write_gguf(out, model.config, tensors, metadata, weight_type="F32", name=folder.name)
    return out


def _post(port: int, body: dict, timeout: float = 300) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def _env(prefix: Path) -> dict:
    return dict(os.environ, LD_LIBRARY_PATH=str(prefix / "lib"), OMP_NUM_THREADS="1")


def _server(prefix: Path, model: Path, rpc: list[str], flags: list[str], ctx: int, log: Path) -> tuple[Server, int]:
    port = free_port()
    cmd = [str(prefix / "bin" / "llama-server"), "-m", str(model), "--port", str(port), "--host", "127.0.0.1"]
    cmd += ["-c", str(ctx), "-t", "1", "-ngl", "99", "--rpc", ",".join(rpc), "-ts", "/".join(["1"] * len(rpc))]
    cmd += ["-np", "1", "--no-webui", *flags]
    server = Server(f"llama-server {' '.join(flags) or 'plain'}", cmd, "0-1", _env(prefix), log)
    server.wait_port(port, 120)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # the port opens before the model is loaded: /health says when
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return server, port
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"llama-server did not become healthy: {' '.join(cmd)}")


def stop(relays: list[Relay], servers: list[Server]) -> None:
    """The links, then the processes behind them."""
    for relay in relays:
        relay.close()
    for server in servers:
        server.stop()


def measure(
    prefix: Path,
    model: Path,
    draft: Path | None,
    n_workers: int,
    delays: list[float],
    prompts: dict[str, list[int]],
    n_gen: int,
    alternations: int,
    draft_max: int,
    shaping,
    log: Path,
) -> list[dict]:
    """llama.cpp's rows for one model and worker count: per delay and prompt, each variant's
    median decode tokens/s over `alternations` runs and the proposals it kept."""
    # lookup as shardwire's: the last 3 tokens looked up, up to draft_max proposed; the draft
    # model whole in the coordinator's process (-ngld 0), as shardwire runs it
    lookup = ["--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(draft_max)]
    variants = {"plain": [], "lookup": ["--spec-type", "ngram-simple", *lookup]}
    if draft is not None:
        variants["draft"] = ["-md", str(draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(draft_max)]
        variants["draft"] += ["-ngld", "0"]
    rpc_servers, relays = [], []
    results: dict = {}
    try:
        for i in range(n_workers):
            port = free_port()
            cmd = [str(prefix / "bin" / "ggml-rpc-server"), "-H", "127.0.0.1", "-p", str(port), "-t", "1"]
            rpc_servers.append(Server(f"ggml-rpc-server-{i}", cmd, "0-1", _env(prefix), log))
            rpc_servers[-1].wait_port(port, 30)
            relays.append(Relay(("127.0.0.1", port), shaping=shaping))
        rpc = [r.address for r in relays]
        for name, flags in variants.items():
            shaping.delay_s = 0.0  # the weights ship without delay
            server, port = _server(prefix, model, rpc, flags, 512, log)
            try:
                for delay in delays:
                    shaping.delay_s = delay / 1000
                    for kind, prompt in prompts.items():
                        body = {"prompt": prompt, "n_predict": n_gen, "temperature": 0, "cache_prompt": False}
                        _post(port, {**body, "n_predict": 8})  # warm at this delay
                        results[(delay, kind, name)] = [_post(port, body) for _ in range(alternations)]
            finally:
                server.stop()
    finally:
        stop(relays, rpc_servers)
    rows = []
    for delay in delays:
        for kind in prompts:
            plain = statistics.median(r["timings"]["predicted_per_second"] for r in results[(delay, kind, "plain")])
            row = {"workers": n_workers, "delay_ms": delay, "prompt": kind, "plain_tps": round(plain, 2)}
            for name in variants:
                if name == "plain":
                    continue
                runs = results[(delay, kind, name)]
                tps = statistics.median(r["timings"]["predicted_per_second"] for r in runs)
                row[name] = {
                    "tps": round(tps, 2),
                    "ratio": round(tps / plain, 3) if plain else None,
                    "draft_n": sum(r["timings"].get("draft_n", 0) for r in runs),
                    "draft_n_accepted": sum(r["timings"].get("draft_n_accepted", 0) for r in runs),
                }
            rows.append(row)
    return rows
