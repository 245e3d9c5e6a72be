"""Rows of activations through ggml's graph with shardwire's own products on and off, side by side,
over about 1 GB of matrices of the 1B layout's FFN shape, one after another. One row (a decode
step; kernels/gemv.cpp on Q8_0 and F16 weights and on Q4_0 and Q4_K held repacked): how many bytes
of weights a second each reads. More rows (a prompt chunk; kernels/vnni_gemm.cpp on Q8_0 and
repacked Q4_0, kernels/float_gemm.cpp on F32 and F16, kernels/kquant_gemm.cpp on Q4_K held
repacked and stored Q6_K): how many multiply-adds a second.

    python -m benchmarks.products [--rows 1] [--types ...] [--rounds 7] [--gbytes 1.0] [-t 1]

Prints the CPU, the ggml build and, per type and kernel, the best and median GB/s (and GFLOP/s)
over the rounds (taken in turns) and the ratio of the medians. Needs shardwire's ggml (kernels/) on a
CPU with AVX-512; elsewhere it says there is nothing to compare.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from shardwire.weights import ggml_cpu, measure
from shardwire.weights.codecs import stored_nbytes
from shardwire.weights.measure import cpu_model

SHAPE = (5632, 2048)  # [out, in]: the 1B layout's gate and up projections
THEIRS = {  # the ggml kernel each of shardwire's products stands in for
    "gemv": {
        "Q8_0": "ggml's dot product",
        "F16": "ggml's dot product",
        "Q4_0": "ggml's repacked GEMV",
        "Q4_K": "ggml's repacked GEMV",
        "IQ2_XXS": "ggml's dot product",
        "IQ3_XXS": "ggml's dot product",
    },
    "gemm": {
        "Q8_0": "llamafile's tinyBLAS",
        "Q4_0": "ggml's repacked GEMM",
        "F32": "llamafile's tinyBLAS",
        "F16": "llamafile's tinyBLAS",
        "Q4_K": "ggml's tiled products",
        "Q6_K": "ggml's tiled products",
    },
}
OURS = {  # the file of shardwire's kernel for each
    "gemv": {
        t: "kernels/lattice_dot.cpp" if t in ("IQ2_XXS", "IQ3_XXS") else "kernels/gemv.cpp" for t in THEIRS["gemv"]
    },
    "gemm": {
        "Q8_0": "kernels/vnni_gemm.cpp",
        "Q4_0": "kernels/vnni_gemm.cpp",
        "F32": "kernels/float_gemm.cpp",
        "F16": "kernels/float_gemm.cpp",
        "Q4_K": "kernels/kquant_gemm.cpp",
        "Q6_K": "kernels/kquant_gemm.cpp",
    },
}


K_QUANT_BLOCKS = {  # a super-block of 256 values, as ggml stores it
    "Q4_K": [("d", "<f2"), ("dmin", "<f2"), ("scales", "u1", 12), ("qs", "u1", 128)],
    "Q6_K": [("ql", "u1", 128), ("qh", "u1", 64), ("scales", "i1", 16), ("d", "<f2")],
}


def matrices(stored: str, gbytes: float) -> list:
    """Random weights (F32 or F16 values; Q8_0, Q4_0, Q4_K or Q6_K blocks with F16 scales in a sane
    range; IQ2_XXS and IQ3_XXS as the kernel measurement's) as ggml layers, Q4_0 and Q4_K in the
    repacked layout shardwire's products read."""
    rng = np.random.default_rng(0)
    nbytes = stored_nbytes(stored, SHAPE)
    out = []
    for _ in range(max(1, int(gbytes * 1e9 // nbytes))):
        if stored in measure.RANDOM_CODES:
            raw = measure.model_like(stored, SHAPE).numpy()
        elif stored in ("F32", "F16"):
            raw = rng.standard_normal(SHAPE).astype(np.float32 if stored == "F32" else np.float16).view(np.uint8)
        elif stored in ("Q4_K", "Q6_K"):
            layout = K_QUANT_BLOCKS[stored]
            blocks = np.empty((SHAPE[0], SHAPE[1] // 256), dtype=layout)
            for name, *_ in layout:  # random bytes; scales of scales in a sane range
                if name in ("d", "dmin"):
                    blocks[name] = rng.uniform(1e-4, 1e-3, blocks.shape)
                elif blocks[name].dtype.base == np.int8:  # Q6_K's signed scales
                    blocks[name] = rng.integers(-64, 64, blocks[name].shape)
                else:
                    blocks[name] = rng.integers(0, 256, blocks[name].shape)
            raw = blocks.view(np.uint8).reshape(SHAPE[0], -1)
        else:
            values = ("i1", 32) if stored == "Q8_0" else ("u1", 16)
            blocks = np.empty((SHAPE[0], SHAPE[1] // 32), dtype=[("d", "<f2"), ("qs", *values)])
            blocks["d"] = rng.uniform(1e-3, 1e-2, blocks.shape)
            blocks["qs"] = rng.integers(-127 if stored == "Q8_0" else 0, 128, blocks["qs"].shape)
            raw = blocks.view(np.uint8).reshape(SHAPE[0], -1)
        kind = ggml_cpu.RepackedLinear if stored in ("Q4_0", "Q4_K") else ggml_cpu.GGMLLinear
        out.append(kind(torch.from_numpy(raw.copy()), stored, SHAPE[1], torch.float32))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1, help="activation rows a product takes (1: a decode step)")
    p.add_argument("--types", help="stored types (default: those with a product of shardwire's for --rows)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--gbytes", type=float, default=1.0, help="weights streamed per timed pass")
    p.add_argument("-t", "--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    kind = "gemv" if args.rows == 1 else "gemm"
    built = ggml_cpu.own_products(kind)
    print(f"cpu: {cpu_model()}  ggml: {ggml_cpu.build() or 'none'}  threads: {args.threads}  rows: {args.rows}")
    if not built:
        print("this ggml has no products of shardwire's for these rows (no AVX-512 here)")
        return 0
    x = torch.randn(args.rows, SHAPE[1])
    used = ggml_cpu.own_products_used(kind)
    try:
        for stored in args.types.split(",") if args.types else built:
            if stored not in built:
                print(f"{stored}: no product of shardwire's for {args.rows} rows")
                continue
            layers = matrices(stored, args.gbytes)
            nbytes = len(layers) * stored_nbytes(stored, SHAPE)
            rates = {"shardwire": [], "ggml": []}
            for _ in range(args.rounds):
                for kernel, rate in rates.items():
                    ggml_cpu.use_own_products([stored] if kernel == "shardwire" else [], kind)
                    t = time.perf_counter()
                    for layer in layers:
                        layer(x)
                    rate.append(nbytes / (time.perf_counter() - t) / 1e9)
            for kernel, rate in rates.items():
                label = (OURS if kernel == "shardwire" else THEIRS)[kind][stored]
                median, shape = statistics.median(rate), f"{len(layers)} x {SHAPE[0]}x{SHAPE[1]}"
                flops = 2 * args.rows * SHAPE[0] * SHAPE[1] / stored_nbytes(stored, SHAPE)  # a byte of weights'
                print(
                    f"{stored} {kernel:9s} ({label}): best {max(rate):5.1f} GB/s  median {median:5.1f} GB/s"
                    f" = {median * flops:6.1f} GFLOP/s  ({shape}, {nbytes / 1e9:.2f} GB)"
                )
            ratio = statistics.median(rates["shardwire"]) / statistics.median(rates["ggml"])
            print(f"{stored} shardwire / ggml: {ratio:.2f}x (medians)")
    finally:
        ggml_cpu.use_own_products(used, kind)
    return 0


if __name__ == "__main__":
    sys.exit(main())
