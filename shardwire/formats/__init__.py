"""Open a model (GGUF file or Hugging Face folder) as a config plus a lazy tensor index."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..config import HYBRID_ARCHS, ConfigError, ModelConfig, from_gguf_metadata, from_hf_config
from .gguf import GGUFError, read_gguf_model
from .names import EXPERT_MATRICES, expert_name, expert_of
from .safetensors import SafetensorsError, read_hf_folder
from .tensors import TensorInfo, TensorReader

__all__ = [
    "ModelFile",
    "ModelError",
    "TensorInfo",
    "TensorReader",
    "block_of",
    "expert_name",
    "expected_shape",
    "open_model",
    "required_tensors",
]

ModelError = (ConfigError, GGUFError, SafetensorsError, FileNotFoundError)
log = logging.getLogger("shardwire.formats")

_BLOCK = re.compile(r"^blk\.(\d+)\.")
_REQUIRED_ATTENTION = (
    "attn_norm.weight",
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_norm.weight",
)
_REQUIRED_DENSE_FFN = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
SHARED_EXPERT = ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
# A Qwen3.5 gated delta-net block's token mixer, and its gated attention block's
_REQUIRED_DELTANET = (
    "attn_norm.weight",
    "attn_qkv.weight",
    "attn_gate.weight",
    "ssm_beta.weight",
    "ssm_alpha.weight",
    "ssm_conv1d.weight",
    "ssm_a",
    "ssm_dt.bias",
    "ssm_norm.weight",
    "ssm_out.weight",
    "ffn_norm.weight",
)
_REQUIRED_GATED_ATTENTION = _REQUIRED_ATTENTION + ("attn_q_norm.weight", "attn_k_norm.weight")


def block_of(name: str) -> int | None:
    m = _BLOCK.match(name)
    return int(m[1]) if m else None


@dataclass
class ModelFile:
    path: Path
    format: str  # "gguf" | "hf"
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    metadata: dict  # GGUF metadata, or config.json for Hugging Face folders
    # llama.cpp's converter stores the Q/K rows of llama-arch models interleaved for its RoPE.
    qk_interleaved: bool

    def block_tensors(self, index: int) -> dict[str, TensorInfo]:
        prefix = f"blk.{index}."
        return {n: t for n, t in self.tensors.items() if n.startswith(prefix)}

    def block_nbytes(self) -> list[int]:
        """Stored bytes of each block's tensors."""
        sizes = [0] * self.config.n_layers
        for name, info in self.tensors.items():
            block = block_of(name)
            if block is not None:
                sizes[block] += info.nbytes
        return sizes

    @property
    def matrix_type(self) -> str | None:
        """The type most of the model's matrix bytes are stored as (F32, F16, BF16, Q4_K, ...)."""
        by_type: dict[str, int] = {}
        for info in self.tensors.values():
            if len(info.shape) >= 2:
                by_type[info.dtype] = by_type.get(info.dtype, 0) + info.nbytes
        return max(by_type, key=by_type.get, default=None)

    def stage_tensors(self, start: int, end: int, first: bool, last: bool) -> dict[str, TensorInfo]:
        """Every tensor a stage holding blocks [start, end) needs."""
        names = [n for n, _ in self.tensors.items() if (b := block_of(n)) is not None and start <= b < end]
        if "rope_freqs.weight" in self.tensors:
            names.append("rope_freqs.weight")
        if first:
            names.append("token_embd.weight")
        if last:
            names.append("output_norm.weight")
            names.append("token_embd.weight" if self.config.tied_embeddings else "output.weight")
        return {n: self.tensors[n] for n in dict.fromkeys(names)}


def open_model(path: str | Path) -> ModelFile:
    """Read a model's header only: config, tokenizer metadata and where every tensor lies."""
    path = Path(path)
    if path.is_dir():
        config_json, tensors = read_hf_folder(path)
        cfg = from_hf_config(config_json, str(path / "config.json"))
        if cfg.tied_embeddings:
            tensors.pop("output.weight", None)
        model = ModelFile(path, "hf", cfg, tensors, config_json, qk_interleaved=False)
    elif path.suffix == ".gguf" or path.is_file():
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such model file or folder")
        metadata, tensors = read_gguf_model(path)
        tensors = _experts_apart(tensors)
        cfg = from_gguf_metadata(metadata, set(tensors), str(path))
        if cfg.arch in HYBRID_ARCHS:
            tensors = _hybrid_names(cfg, tensors, path)
        model = ModelFile(path, "gguf", cfg, tensors, metadata, qk_interleaved=cfg.arch in ("llama", "mistral"))
    else:
        raise FileNotFoundError(f"{path}: no such model file or folder")
    _check_tensors(model)
    return model


def _experts_apart(tensors: dict[str, TensorInfo]) -> dict[str, TensorInfo]:
    """GGUF's 3-D expert tensors as one 2-D matrix per expert (each a contiguous part of the file)."""
    out = {}
    for name, info in tensors.items():
        parts = name.split(".")
        if parts[-2:] == ["ffn_gate_inp_shexp", "weight"] and len(info.shape) == 1:
            # the shared expert's gate is one row: the same bytes, whether stored 1-D or [1, dim]
            info = TensorInfo(info.name, info.dtype, (1, info.shape[0]), info.path, info.offset, info.nbytes)
        if len(parts) == 4 and parts[2] in EXPERT_MATRICES and len(info.shape) == 3:
            block, matrix = int(parts[1]), parts[2]
            for e, part in enumerate(info.split(info.shape[0])):
                out[expert_name(block, matrix, e)] = part.renamed(expert_name(block, matrix, e))
        else:
            out[name] = info
    return out


def _hybrid_names(cfg: ModelConfig, tensors: dict[str, TensorInfo], path: Path) -> dict[str, TensorInfo]:
    """A qwen35 GGUF's tensors under shardwire's names: its pre-FFN norm is post_attention_norm
    (ffn_norm here, as for every other model), the blocks of
    multi-token prediction the converter appends past n_layers are left out."""
    out, mtp = {}, 0
    for name, info in tensors.items():
        block = block_of(name)
        if block is not None and block >= cfg.n_layers:
            mtp += 1
            continue
        if name.endswith(".post_attention_norm.weight"):
            name = name.replace(".post_attention_norm.", ".ffn_norm.")
            info = info.renamed(name)
        out[name] = info
    if mtp:
        log.info("%s: skipping %d tensors of multi-token-prediction blocks: shardwire does not run them", path, mtp)
    return out


def _FFN_SHAPES(cfg: ModelConfig, short: str, shared: int | None):
    return {
        "ffn_norm.weight": (cfg.dim,),
        "ffn_gate_inp.weight": (cfg.n_experts, cfg.dim) if cfg.n_experts else None,
        "ffn_gate_inp_shexp.weight": (1, cfg.dim) if shared else None,
        "ffn_gate_shexp.weight": (shared, cfg.dim) if shared else None,
        "ffn_up_shexp.weight": (shared, cfg.dim) if shared else None,
        "ffn_down_shexp.weight": (cfg.dim, shared) if shared else None,
        "ffn_gate.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_up.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_down.weight": (cfg.dim, cfg.ffn_dim),
    }.get(short)


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape a tensor of this name must have in a model of `cfg`; None for unknown names."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if block_of(name) is None:
        return {
            "token_embd.weight": (cfg.vocab_size, cfg.dim),
            "output.weight": (cfg.vocab_size, cfg.dim),
            "output_norm.weight": (cfg.dim,),
            "rope_freqs.weight": (cfg.head_dim // 2,),
        }.get(name)
    expert = expert_of(name)
    if expert:
        _, matrix, e = expert
        if e >= cfg.n_experts:
            return None
        f = cfg.expert_ffn_dim
        return (cfg.dim, f) if matrix == "ffn_down_exps" else (f, cfg.dim)
    short = name.split(".", 2)[2]
    shared = cfg.shared_expert_ffn_dim or None
    if cfg.linear(block_of(name)):
        v, hv = cfg.ssm_v_heads * cfg.ssm_v_dim, cfg.ssm_v_heads
        return {
            "attn_norm.weight": (cfg.dim,),
            "attn_qkv.weight": (cfg.conv_channels, cfg.dim),
            "attn_gate.weight": (v, cfg.dim),
            "ssm_beta.weight": (hv, cfg.dim),
            "ssm_alpha.weight": (hv, cfg.dim),
            "ssm_conv1d.weight": (cfg.conv_channels, cfg.ssm_conv_kernel),
            "ssm_a": (hv,),
            "ssm_dt.bias": (hv,),
            "ssm_norm.weight": (cfg.ssm_v_dim,),
            "ssm_out.weight": (cfg.dim, v),
        }.get(short, _FFN_SHAPES(cfg, short, shared))
    if cfg.gated_attention and short == "attn_q.weight":
        return (2 * q, cfg.dim)  # each head's queries, then its output gate
    return {
        "ffn_gate_inp.weight": (cfg.n_experts, cfg.dim) if cfg.n_experts else None,
        "ffn_gate_inp_shexp.weight": (1, cfg.dim) if shared else None,
        "ffn_gate_shexp.weight": (shared, cfg.dim) if shared else None,
        "ffn_up_shexp.weight": (shared, cfg.dim) if shared else None,
        "ffn_down_shexp.weight": (cfg.dim, shared) if shared else None,
        "attn_norm.weight": (cfg.dim,),
        "ffn_norm.weight": (cfg.dim,),
        "attn_q.weight": (q, cfg.dim),
        "attn_q.bias": (q,),
        "attn_k.weight": (kv, cfg.dim),
        "attn_k.bias": (kv,),
        "attn_v.weight": (kv, cfg.dim),
        "attn_v.bias": (kv,),
        "attn_output.weight": (cfg.dim, q),
        "attn_output.bias": (cfg.dim,),
        "attn_q_norm.weight": (cfg.head_dim,),
        "attn_k_norm.weight": (cfg.head_dim,),
        "ffn_gate.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_up.weight": (cfg.ffn_dim, cfg.dim),
        "ffn_down.weight": (cfg.dim, cfg.ffn_dim),
    }.get(short)


def required_tensors(cfg: ModelConfig, start: int, end: int, first: bool, last: bool) -> list[str]:
    """Tensors a stage holding blocks [start, end) cannot do without."""
    names = ["token_embd.weight"] if first else []
    for i in range(start, end):
        if cfg.linear(i):
            names += [f"blk.{i}.{s}" for s in _REQUIRED_DELTANET]
        elif cfg.gated_attention:
            names += [f"blk.{i}.{s}" for s in _REQUIRED_GATED_ATTENTION]
        else:
            names += [f"blk.{i}.{s}" for s in _REQUIRED_ATTENTION]
        if cfg.arch in ("qwen3", "qwen3moe"):
            names += [f"blk.{i}.attn_q_norm.weight", f"blk.{i}.attn_k_norm.weight"]
        if cfg.sparse(i):
            names.append(f"blk.{i}.ffn_gate_inp.weight")
            if cfg.shared_expert_ffn_dim:
                names += [f"blk.{i}.{m}.weight" for m in SHARED_EXPERT]
            names += [expert_name(i, m, e) for e in range(cfg.n_experts) for m in EXPERT_MATRICES]
        else:
            names += [f"blk.{i}.{s}" for s in _REQUIRED_DENSE_FFN]
    if last:
        names += ["output_norm.weight", "token_embd.weight" if cfg.tied_embeddings else "output.weight"]
    return list(dict.fromkeys(names))


def _check_tensors(model: ModelFile) -> None:
    cfg, where = model.config, model.path
    missing = [n for n in required_tensors(cfg, 0, cfg.n_layers, True, True) if n not in model.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"{where}: missing tensor '{missing[0]}'{more}")
    for name, info in model.tensors.items():
        block = block_of(name)
        if block is not None and block >= cfg.n_layers:
            raise ConfigError(
                f"{where}: tensor '{name}' belongs to block {block} but the model has {cfg.n_layers} blocks"
            )
        expected = expected_shape(cfg, name)
        if expected is not None and tuple(info.shape) != expected:
            raise ConfigError(
                f"{where}: tensor '{name}' has shape {list(info.shape)}, "
                f"expected {list(expected)} for this model's config"
            )
