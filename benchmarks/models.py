"""The benchmark's model files: real GGUF with random weights, written by shardwire's writer
(F16), or for a family it does not write (gpt-oss) made by transformers from its own config class
and converted by llama.cpp's converter, then quantized by llama.cpp's own llama-quantize, cached by
name.

    python -m benchmarks.models [small 1b-q8_0 ...]    # make (or find) them, print their paths

Random weights are fine for speed: every matrix has the shape and storage type of a real
model of that layout, and llama.cpp loads the files (the harness checks it does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .packed_models import importance_matrix

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("SHARDWIRE_BENCH_CACHE", Path.home() / ".cache" / "shardwire" / "bench"))
# Bump when a layout or the way files are made changes, so stale files are not reused.
LAYOUT_VERSION = 1


@dataclass(frozen=True)
class Layout:
    name: str
    params: dict  # shardwire_kit.synthetic.random_model arguments besides vocab_size, or `converted`'s config
    vocab: str = "llama-spm"  # a llama.cpp vocabulary in ../shared/vocab (32000 tokens for Llama 2)
    converted: str = ""  # a shardwire_kit.convert builder of a transformers folder that llama.cpp's converter reads


_MOE = dict(
    arch="qwen3moe",
    n_layers=16,
    dim=1024,
    n_heads=16,
    n_kv_heads=4,
    head_dim=64,
    ffn_dim=3072,
    n_experts=32,
    expert_ffn_dim=512,
    context_length=2048,
)
# A small Qwen3.5-MoE: gated delta-net blocks with gated attention every fourth, 32 experts (4
# per token) and a shared expert; a Llama 2-sized vocabulary keeps the head from dominating.
_MOE35 = dict(
    arch="qwen35moe",
    n_layers=8,
    dim=512,
    n_heads=8,
    n_kv_heads=2,
    head_dim=64,
    ffn_dim=256,
    n_experts=32,
    n_experts_used=4,
    expert_ffn_dim=256,
    shared_expert_ffn_dim=256,
    linear_heads=(4, 8),
    linear_head_dims=(64, 64),
    context_length=2048,
)
LAYOUTS = {
    # A model small enough that the network, not the arithmetic, dominates decode.
    "small": Layout(
        "small", dict(arch="llama", n_layers=8, dim=512, n_heads=8, n_kv_heads=4, ffn_dim=1536, context_length=2048)
    ),
    # TinyLlama-1.1B's layout.
    "1b": Layout(
        "1b", dict(arch="llama", n_layers=22, dim=2048, n_heads=32, n_kv_heads=4, ffn_dim=5632, context_length=2048)
    ),
    # A 1B-class mixture of experts shaped like Qwen3-MoE: 32 experts, 4 per token (with the same
    # weights routed to 2 and to 8, so a step's cost can be set against the experts it runs).
    **{name: Layout(name, dict(_MOE, n_experts_used=k)) for name, k in (("moe", 4), ("moe-top2", 2), ("moe-top8", 8))},
    "moe35": Layout("moe35", _MOE35),
    # gpt-oss-20b's blocks at 1B scale: 16 blocks alternating a 128-position window and full
    # attention, 16 heads of 64 (4 key heads) with sinks, 32 experts (4 a token) of width 512 with
    # biases and the clamped SwiGLU, YaRN as published; GPT-2's vocabulary (50k) with harmony's tokens
    "oss": Layout(
        "oss",
        dict(
            layers=16,
            hidden_size=1024,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            intermediate_size=512,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 150000.0,
                "factor": 32.0,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
            initializer_range=0.02,
        ),
        converted="tiny_gpt_oss",
    ),
    # DeepSeek-V3's blocks at 1B scale: 16 blocks (the first dense) of latent attention (16 heads,
    # a 512-value latent and 64 rotated dimensions, as V3's; queries through a 384-wide bottleneck),
    # then 32 experts of width 512 in 4 groups (2 groups and 4 experts a token) beside a shared one
    "deepseek": Layout(
        "deepseek",
        dict(
            layers=16,
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=512,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=384,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            n_routed_experts=32,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            initializer_range=0.02,
        ),
        converted="tiny_deepseek3",
    ),
}


@dataclass(frozen=True)
class Workload:
    name: str  # e.g. "1b-q4_0"
    layout: str
    type: str  # storage type of the matrices: F32, F16, Q8_0, Q4_0, Q4_K, IQ4_XS, IQ2_XXS

    @property
    def path(self) -> Path:
        return CACHE / "models" / f"v{LAYOUT_VERSION}" / f"{self.name}.gguf"


WORKLOADS = {
    w.name: w
    for w in [
        Workload("small-f16", "small", "F16"),
        Workload("small-f32", "small", "F32"),
        Workload("1b-q8_0", "1b", "Q8_0"),
        Workload("1b-q4_0", "1b", "Q4_0"),
        Workload("1b-q4_k", "1b", "Q4_K"),  # llama-quantize's Q4_K_M mix
        Workload("1b-f16", "1b", "F16"),
        Workload("1b-bf16", "1b", "BF16"),  # as the big models' own weights are published
        # the codebook types of unsloth's big-MoE files, llama-quantize's recipes with an importance
        # matrix from llama-imatrix (IQ2_XXS needs one)
        Workload("1b-iq4_xs", "1b", "IQ4_XS"),
        Workload("1b-iq2_xxs", "1b", "IQ2_XXS"),
        Workload("1b-iq1_s", "1b", "IQ1_S"),
        Workload("1b-iq1_m", "1b", "IQ1_M"),
        Workload("1b-iq2_xs", "1b", "IQ2_XS"),
        Workload("1b-iq2_s", "1b", "IQ2_S"),  # llama-quantize's IQ2_M recipe, which stores IQ2_S
        Workload("1b-iq3_xxs", "1b", "IQ3_XXS"),
        Workload("1b-iq3_s", "1b", "IQ3_S"),
        Workload("1b-iq4_nl", "1b", "IQ4_NL"),
        Workload("moe-q4_0", "moe", "Q4_0"),
        Workload("moe-q8_0", "moe", "Q8_0"),
        Workload("moe-q4_k", "moe", "Q4_K"),  # llama-quantize's Q4_K_M mix, as MoE users download
        Workload("moe-top2-q4_0", "moe-top2", "Q4_0"),
        Workload("moe-top8-q4_0", "moe-top8", "Q4_0"),
        Workload("moe35-q8_0", "moe35", "Q8_0"),
        Workload("moe35-f16", "moe35", "F16"),
        Workload("oss-mxfp4", "oss", "MXFP4"),  # llama-quantize's MXFP4_MOE: the experts MXFP4, as gpt-oss ships
        Workload("deepseek-q4_k", "deepseek", "Q4_K"),  # llama-quantize's Q4_K_M mix
        Workload("deepseek-iq2_xxs", "deepseek", "IQ2_XXS"),  # as unsloth's smallest DeepSeek files
    ]
}

# llama-quantize's names for the types (Q4_K means its Q4_K_M recipe, what users download).
_QUANTIZE_NAME = {
    "Q8_0": "Q8_0",
    "Q4_0": "Q4_0",
    "Q4_K": "Q4_K_M",
    "F16": "F16",
    "F32": "F32",
    "MXFP4": "MXFP4_MOE",
    "IQ2_S": "IQ2_M",
}
# quantized with an importance matrix (llama-imatrix over the README), as the codebook types' files are
_IMPORTANCE = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS")


def llama_cpp_prefix(build: bool = True) -> Path | None:
    """The cached llama.cpp build (benchmarks/build_llama_cpp.sh builds it once), or None."""
    script = HERE / "build_llama_cpp.sh"
    if not build:
        return None
    try:
        out = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True, timeout=3600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, FileNotFoundError) as e:
        detail = getattr(e, "stderr", "") or ""
        print(f"llama.cpp build failed: {e}\n{detail[-2000:]}", file=sys.stderr)
        return None
    prefix = Path(out.stdout.strip().splitlines()[-1])
    return prefix if (prefix / "bin" / "llama-bench").is_file() else None


def _f16_file(layout: Layout) -> Path:
    path = CACHE / "models" / f"v{LAYOUT_VERSION}" / f"{layout.name}-f16.gguf"
    if path.is_file():
        return path
    if layout.converted:
        import shutil
        import tempfile

        from shardwire_kit import convert

        said = f"writing {path.name} (transformers' random weights, llama.cpp's converter) ..."
        print(said, file=sys.stderr, flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=f"{layout.name}-hf-", dir=path.parent))
        try:
            getattr(convert, layout.converted)(folder, seed=1234, **layout.params)
            convert.convert(folder, path.with_suffix(".tmp.gguf"), outtype="f16")
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(path.with_suffix(".tmp.gguf"), path)
        return path
    from shardwire_kit.synthetic import load_vocab, random_model
    from shardwire_kit.writer import write_gguf

    vocab = load_vocab(layout.vocab)
    print(f"writing {path.name} (random weights, F16) ...", file=sys.stderr, flush=True)
    cfg, tensors = random_model(**layout.params, vocab_size=vocab.size, seed=1234)
    write_gguf(path, cfg, tensors, vocab.gguf_metadata, weight_type="F16", name=f"shardwire-bench-{layout.name}")
    return path


def ensure(workload: Workload, prefix: Path | None) -> Path:
    """The workload's GGUF file, made if missing. F16 files come from shardwire's writer; the
    quantized ones from llama-quantize (or, without llama.cpp, from shardwire's writer)."""
    path = workload.path
    if path.is_file():
        return path
    layout = LAYOUTS[workload.layout]
    f16 = _f16_file(layout)
    if workload.type == "F16":
        return f16
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.gguf")
    if prefix is not None:
        print(f"quantizing {path.name} with llama-quantize ...", file=sys.stderr, flush=True)
        importance = []
        if workload.type in _IMPORTANCE:
            imatrix = importance_matrix(f16, f16.with_suffix(".imatrix.gguf"), prefix=prefix)
            importance = ["--imatrix", str(imatrix)]
        subprocess.run(
            [
                str(prefix / "bin" / "llama-quantize"),
                *importance,
                str(f16),
                str(tmp),
                _QUANTIZE_NAME.get(workload.type, workload.type),
                str(os.cpu_count() or 1),
            ],
            check=True,
            capture_output=True,
            timeout=3600,
        )
    elif layout.converted:
        raise RuntimeError(f"{workload.name} is made by llama-quantize (benchmarks/build_llama_cpp.sh builds it)")
    else:
        from shardwire_kit.synthetic import load_vocab, random_model
        from shardwire_kit.writer import write_gguf

        vocab = load_vocab(layout.vocab)
        print(f"writing {path.name} with shardwire's writer ...", file=sys.stderr, flush=True)
        cfg, tensors = random_model(**layout.params, vocab_size=vocab.size, seed=1234)
        write_gguf(
            tmp, cfg, tensors, vocab.gguf_metadata, weight_type=workload.type, name=f"shardwire-bench-{layout.name}"
        )
    os.replace(tmp, path)
    return path


def describe(path: Path) -> dict:
    """Size and the storage types of a GGUF file's tensors (bytes per type)."""
    from shardwire.formats import open_model

    model = open_model(path)
    types: dict[str, int] = {}
    for info in model.tensors.values():
        types[info.dtype] = types.get(info.dtype, 0) + info.nbytes
    cfg = model.config
    return {
        "file": str(path),
        "bytes": path.stat().st_size,
        "tensor_types": types,
        "layout": {
            "n_layers": cfg.n_layers,
            "dim": cfg.dim,
            "ffn_dim": cfg.ffn_dim,
            "n_heads": cfg.n_heads,
            "n_kv_heads": cfg.n_kv_heads,
            "vocab_size": cfg.vocab_size,
            **(
                {"experts": cfg.n_experts, "experts_used": cfg.n_experts_used, "expert_ffn_dim": cfg.expert_ffn_dim}
                if cfg.n_experts
                else {}
            ),
        },
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workloads", nargs="*", default=list(WORKLOADS), help=f"of {', '.join(WORKLOADS)}")
    p.add_argument("--no-llama-cpp", action="store_true", help="write every file with shardwire's writer")
    args = p.parse_args()
    prefix = None if args.no_llama_cpp else llama_cpp_prefix()
    for name in args.workloads:
        path = ensure(WORKLOADS[name], prefix)
        print(json.dumps({"workload": name, **describe(path)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
