"""Model files for the packed-weights benchmark and numerics: a 1B-class random Llama (22 blocks,
width 2048, FFN 5632, 32 heads / 4 KV heads, 32000-token vocabulary, as TinyLlama) written as F16
by shardwire's writer and quantized by llama.cpp's own llama-quantize (Q4_0, Q8_0, Q4_K_M), and
the trained glassllm model the same way.

    python -m benchmarks.packed_models [--out DIR] [--small]

Needs llama.cpp built by benchmarks/build_llama_cpp.sh (for llama-quantize); prints the paths.
"""

from __future__ import annotations

import argparse
import os
import subprocess
from pathlib import Path

LLAMA_CPP = Path(os.environ.get("LLAMA_CPP_PREFIX", Path.home() / ".cache/shardwire/llama.cpp/0.3.36"))
TYPES = ("Q4_0", "Q8_0", "Q4_K_M")
ONE_B = dict(arch="llama", n_layers=22, dim=2048, n_heads=32, n_kv_heads=4, ffn_dim=5632, context_length=2048)
SMALL = dict(arch="llama", n_layers=4, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1408, context_length=1024)


# Text llama-imatrix runs the model over to weigh each column's importance: this repository's README
CALIBRATION = Path(__file__).resolve().parents[1] / "README.md"


def _tool(name: str, *args: str, prefix: Path = LLAMA_CPP) -> None:
    env = dict(os.environ, LD_LIBRARY_PATH=str(prefix / "lib"))
    done = subprocess.run([str(prefix / "bin" / name), *args], env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{name} {' '.join(args)} failed:\n{done.stderr[-2000:]}")


def importance_matrix(src: Path, dst: Path, ctx: int = 128, chunks: int = 8, prefix: Path = LLAMA_CPP) -> Path:
    """llama-imatrix over CALIBRATION: the importance matrix the IQ1/IQ2 types need."""
    if not dst.exists():
        _tool("llama-imatrix", "-m", str(src), "-f", str(CALIBRATION), "-o", str(dst), "-c", str(ctx),
              "--chunks", str(chunks), "-t", str(os.cpu_count() or 1), prefix=prefix)  # fmt: skip
    return dst


def quantize(src: Path, dst: Path, kind: str, imatrix: Path | None = None) -> Path:
    """llama-quantize src -> dst (kind: Q4_0, Q8_0, Q4_K_M, IQ2_XXS, MXFP4_MOE, ...), with an importance
    matrix where given; --allow-requantize is not needed for an F16 or F32 source."""
    if not dst.exists():
        _tool("llama-quantize", *(["--imatrix", str(imatrix)] if imatrix else []), str(src), str(dst), kind)
    return dst


def random_llama(out: Path, params: dict, name: str) -> dict[str, Path]:
    from shardwire_kit.synthetic import load_vocab, random_model
    from shardwire_kit.writer import write_gguf

    out.mkdir(parents=True, exist_ok=True)
    f16 = out / f"{name}-F16.gguf"
    if not f16.exists():
        vocab = load_vocab("llama-spm")
        cfg, tensors = random_model(**params, vocab_size=vocab.size, seed=1)
        write_gguf(f16, cfg, tensors, vocab.gguf_metadata, weight_type="F16", name=name)
        del tensors
    return {"F16": f16, **{t: quantize(f16, out / f"{name}-{t}.gguf", t) for t in TYPES}}


def glassllm_files(out: Path) -> dict[str, Path]:
    """glassllm as F32 (it ships fp16, so this is lossless) and llama-quantize's Q4_0, Q8_0, Q4_K_M:
    its width of 128 and FFN of 341 leave llama.cpp to fall back where blocks do not fit."""
    from shardwire_kit.glassllm import convert_glassllm

    out.mkdir(parents=True, exist_ok=True)
    f32 = out / "glassllm-F32.gguf"
    if not f32.exists():
        convert_glassllm(f32, "gguf", weight_type="F32")
    return {"F32": f32, **{t: quantize(f32, out / f"glassllm-{t}.gguf", t) for t in TYPES}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=str(Path.home() / ".cache/shardwire/bench-models"))
    p.add_argument("--small", action="store_true", help="a 4-block width-512 model instead of the 1B-class one")
    args = p.parse_args()
    out = Path(args.out)
    files = random_llama(out, SMALL if args.small else ONE_B, "rand-small" if args.small else "rand-1b")
    files.update({f"glassllm-{k}": v for k, v in glassllm_files(out).items()})
    for kind, path in files.items():
        print(f"{kind}\t{path}\t{path.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
