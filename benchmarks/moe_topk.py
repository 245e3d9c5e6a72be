"""What a mixture of experts' decode step costs against the experts it runs: the same weights
routed to 2, 4 and 8 of 32 experts per token, decoded in one process, interleaved.

    python -m benchmarks.moe_topk [--tokens 32] [--rounds 3] [--dtype float32]

Prints, per top-k file: ms per decoded token (median over rounds, each round the files in
A B C C B A order), the bytes of expert weights a token reads (k x one expert's gate, up and
down in every block), and against the top-2 file what the extra experts cost: their ms and the
rate they were read at (extra MiB / extra ms), so the cost of each extra expert shows beside its
bytes. A stage whose decode step is one ggml graph (routing and experts inside it) is timed
whole; the files come from benchmarks/models.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights.measure import fastest_formats

from . import models
from .run import machine_info

WORKLOADS = ("moe-top2-q4_0", "moe-q4_0", "moe-top8-q4_0")


def load(path: Path, dtype: str):
    model = open_model(path)
    fastest = fastest_formats("cpu", dtype)
    stage = load_stage(model, 0, model.config.n_layers, dtype=getattr(torch, dtype), weights="fast", fastest=fastest)
    stage.allocate_cache(1, 512)
    expert = sum(model.tensors[f"blk.0.{m}.0.weight"].nbytes for m in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    per_token = expert * model.config.n_experts_used * model.config.n_layers
    kind = type(stage.blocks[0].ffn.grouped or stage.blocks[0].ffn.experts[0].down).__name__
    if stage.runner is not None:
        kind += ", the step one ggml graph"
    return stage, per_token, kind


def decode(stage, tokens: int) -> float:
    """ms per token."""
    stage(torch.tensor([[1, 2, 3, 4]]), [0], [0])
    start = time.perf_counter()
    for i in range(tokens):
        stage(torch.tensor([[5 + i]]), [0], [4 + i])
    return (time.perf_counter() - start) / tokens * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    prefix = models.llama_cpp_prefix()
    loaded = {w: load(models.ensure(models.WORKLOADS[w], prefix), args.dtype) for w in WORKLOADS}
    times: dict[str, list[float]] = {w: [] for w in WORKLOADS}
    for r in range(args.rounds):
        order = WORKLOADS + tuple(reversed(WORKLOADS))
        for w in order:
            times[w].append(decode(loaded[w][0], args.tokens))
    info = machine_info()
    print(
        f"{info.get('cpu')}, {args.threads} thread(s), compute {args.dtype}, {args.tokens} tokens x {2 * args.rounds}"
    )
    print("| file | experts per token | expert MiB read per token | ms/token | extra ms, extra MiB/s | run by |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    base = None
    for w in WORKLOADS:
        stage, per_token, kind = loaded[w]
        ms, mib = statistics.median(times[w]), per_token / 2**20
        extra = "-" if base is None else f"{ms - base[0]:.2f} ms, {(mib - base[1]) / (ms - base[0]) * 1e3:.0f} MiB/s"
        base = base or (ms, mib)
        k = stage.cfg.n_experts_used
        print(f"| {w} | {k} of {stage.cfg.n_experts} | {mib:.1f} | {ms:.2f} | {extra} | {kind} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
