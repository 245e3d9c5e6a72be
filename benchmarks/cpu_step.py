"""Where a CPU decode step's time goes: the whole step of one stage holding every block, against
its matrix products alone (every weight multiplied by one row, back to back in one ggml graph: the
floor ggml's kernels set), and the share of the step outside them.

    python -m benchmarks.cpu_step [--workloads 1b-q4_0,1b-f16,...] [--steps 64] [-t 1]

Prints, per file: the CPU, the compute dtype and the kernel path of each stored type, ms per
token of the step, ms of the products alone and the share outside them (attention over the
cache, norms, RoPE, the block graphs' glue, Python).
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time

import numpy as np
import torch

from shardwire.backends.ggml.block import _matrices
from shardwire.devices import parse_dtype, stored_precision_dtype
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu
from shardwire.weights.ggml_cpu import ggml
from shardwire.weights.measure import cpu_model, fastest_formats
from shardwire.weights.policy import default_dtype

from . import models


def products_alone(stage) -> float:
    """Seconds for every matrix the stage multiplies in a decode step, one row each, in one graph."""
    matrices = []
    for i, block in enumerate(stage.blocks):  # the blocks' own graphs name every matrix they multiply
        g = block.runner
        if g is None:
            raise SystemExit(f"block {i} runs no ggml graphs: nothing to compare against")
        matrices += [*g.qkv, g.out, *g.ffn.matrices]
    if stage.last:
        matrices += _matrices(stage.head) or []
    ctx = ggml.ggml_init(
        ggml.ggml_init_params(
            mem_size=ggml.ggml_tensor_overhead() * (3 * len(matrices) + 8)
            + ggml.ggml_graph_overhead_custom(2 * len(matrices), False),
            no_alloc=True,
        )
    )
    graph, kept = ggml.ggml_new_graph_custom(ctx, 2 * len(matrices), False), []
    for m in matrices:
        x = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, m.K, 1)
        y = ggml.ggml_mul_mat(ctx, m.tensor(ctx), x)
        for t, n in ((x, m.K), (y, m.N)):
            buffer = np.zeros(n, np.float32)
            kept.append(buffer)
            t.contents.data = buffer.ctypes.data
        ggml.ggml_build_forward_expand(graph, y)
    plan = ggml.ggml_graph_plan(graph, torch.get_num_threads(), None)
    work = np.empty(max(plan.work_size, 1), np.uint8)
    plan.work_data = work.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
    ggml.ggml_graph_compute(graph, ctypes.byref(plan))
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        ggml.ggml_graph_compute(graph, ctypes.byref(plan))
        best = min(best, time.perf_counter() - t)
    ggml.ggml_free(ctx)
    return best


def whole_step(stage, steps: int) -> float:
    """Fastest seconds of a decode step of one sequence, positions 16.. (a short context); the
    fastest, as for the products alone: other work on a shared machine only ever adds time."""
    stage.allocate_cache(1, 16 + steps + 1)
    stage(torch.tensor([list(range(1, 17))]), [0], [0])
    times = []
    for i in range(steps):
        t = time.perf_counter()
        stage(torch.tensor([[5]]), [0], [16 + i])
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="1b-q4_0,1b-q4_k,1b-q8_0,1b-f16,small-f16")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    if not ggml_cpu.available():
        print("ggml's kernels are not built here: nothing to compare against")
        return 1
    torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_model()}, {args.threads} thread(s), ggml: {ggml_cpu.build()}")
    print("| file | dtype | kernels | step ms/token | products alone ms | outside the products |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for name in args.workloads.split(","):
        workload = models.WORKLOADS[name]
        model = open_model(models.ensure(workload, models.llama_cpp_prefix(build=workload.type != "F16")))
        dtype = stored_precision_dtype(default_dtype("cpu"), "cpu", model.matrix_type)
        fastest = fastest_formats("cpu", dtype)
        stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest=fastest, dtype=parse_dtype(dtype))
        kernels = sorted({f"{m.stored}:{m.fmt}" for m in stage.modules() if hasattr(m, "stored")})
        step, floor = whole_step(stage, args.steps), products_alone(stage)
        print(
            f"| {name} | {dtype} | {' '.join(kernels)} | {step * 1e3:.1f} | {floor * 1e3:.1f} "
            f"| {(step - floor) / step:.0%} |"
        )
        del stage
    return 0


if __name__ == "__main__":
    sys.exit(main())
