"""What a mixture of experts' decode step costs against the experts it runs: the same weights
routed to 2, 4 and 8 of 32 experts per token, decoded in one process, interleaved.

    python benchmarks/moe_topk.py [--tokens 32] [--rounds 3] [--dtype float32]

Prints, per top-k file: ms per decoded token (median over rounds, each round the files in
A B C C B A order), the bytes of expert weights a token reads (k x one expert's gate, up and
down in every block), and the time a token spends routing and in the experts, so the
cost of each extra expert shows beside its bytes. The files come from benchmarks/models.py.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from run import machine_info  # noqa: E402

from shardwire.formats import open_model  # noqa: E402
from shardwire.loading import load_stage  # noqa: E402
from shardwire.model import MixtureOfExperts  # noqa: E402
from shardwire.quant.measure import fastest_formats  # noqa: E402

import models  # noqa: E402

WORKLOADS = ("moe-top2-q4_0", "moe-q4_0", "moe-top8-q4_0")


def load(path: Path, dtype: str):
    model = open_model(path)
    fastest = fastest_formats("cpu", dtype)
    stage = load_stage(model, 0, model.config.n_layers, dtype=getattr(torch, dtype), weights="fast", fastest=fastest)
    stage.allocate_cache(1, 512)
    moe_seconds = [0.0]

    def timed(module, forward):
        def run(x):
            t = time.perf_counter()
            y = forward(x)
            moe_seconds[0] += time.perf_counter() - t
            return y

        module.routed = run

    for block in stage.blocks:
        if isinstance(block.ffn, MixtureOfExperts):
            timed(block.ffn, block.ffn.routed)
    expert = sum(model.tensors[f"blk.0.{m}.0.weight"].nbytes for m in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"))
    per_token = expert * model.config.n_experts_used * model.config.n_layers
    kind = type(stage.blocks[0].ffn.grouped or stage.blocks[0].ffn.experts[0].down).__name__
    return stage, moe_seconds, per_token, kind


def decode(stage, moe_seconds, tokens: int) -> tuple[float, float]:
    """ms per token in all, and in the expert products."""
    stage(torch.tensor([[1, 2, 3, 4]]), [0], [0])
    moe_seconds[0] = 0.0
    start = time.perf_counter()
    for i in range(tokens):
        stage(torch.tensor([[5 + i]]), [0], [4 + i])
    return (time.perf_counter() - start) / tokens * 1e3, moe_seconds[0] / tokens * 1e3


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
    times: dict[str, list[tuple[float, float]]] = {w: [] for w in WORKLOADS}
    for r in range(args.rounds):
        order = WORKLOADS + tuple(reversed(WORKLOADS))
        for w in order:
            stage, moe_seconds, _, _ = loaded[w]
            times[w].append(decode(stage, moe_seconds, args.tokens))
    info = machine_info()
    print(
        f"{info.get('cpu')}, {args.threads} thread(s), compute {args.dtype}, {args.tokens} tokens x {2 * args.rounds}"
    )
    print("| file | experts per token | expert MiB read per token | ms/token | routing and experts | experts run by |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for w in WORKLOADS:
        stage, _, per_token, kind = loaded[w]
        total = statistics.median(t for t, _ in times[w])
        moe = statistics.median(m for _, m in times[w])
        k = stage.cfg.n_experts_used
        print(f"| {w} | {k} of {stage.cfg.n_experts} | {per_token / 2**20:.1f} | {total:.2f} | {moe:.2f} | {kind} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
