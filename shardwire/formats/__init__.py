"""Open a model (GGUF file or Hugging Face folder) as a config plus a lazy tensor index."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError, ModelConfig
from ..models import block_of, family_of, from_gguf_metadata, from_hf_config, variant
from .gguf import GGUFError, read_gguf_model
from .names import EXPERT_MATRICES, expert_name, expert_of
from .safetensors import SafetensorsError, read_hf_folder
from .tensors import TensorInfo, TensorReader

log = logging.getLogger("shardwire.formats")

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
        tensors = _without_mtp(tensors, cfg, config_json.get("num_nextn_predict_layers", 0), path)
        if cfg.tied_embeddings:
            tensors.pop("output.weight", None)
        model = ModelFile(path, "hf", cfg, tensors, config_json, qk_interleaved=False)
    elif path.suffix == ".gguf" or path.is_file():
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such model file or folder")
        metadata, tensors = read_gguf_model(path)
        tensors = _experts_apart(tensors)
        cfg = from_gguf_metadata(metadata, set(tensors), str(path))
        family = family_of(cfg.arch)
        tensors = _without_mtp(tensors, cfg, metadata.get(f"{cfg.arch}.nextn_predict_layers", 0), path)
        tensors = family.gguf_tensors(cfg, tensors, path)
        model = ModelFile(path, "gguf", cfg, tensors, metadata, qk_interleaved=cfg.arch in family.qk_interleaved)
    else:
        raise FileNotFoundError(f"{path}: no such model file or folder")
    _check_tensors(model)
    return model


def _without_mtp(tensors: dict[str, TensorInfo], cfg: ModelConfig, declared, path: Path) -> dict[str, TensorInfo]:
    """The tensors less those of the `declared` blocks of multi-token prediction a checkpoint
    carries past its last block (GLM-4.5, DeepSeek-V3): shardwire does not run them, nor does
    transformers."""
    if not declared:
        return tensors
    kept = {name: info for name, info in tensors.items() if (block_of(name) or 0) < cfg.n_layers}
    if len(kept) < len(tensors):
        log.info(
            "%s: skipping %d tensors of multi-token-prediction blocks: shardwire does not run them",
            path,
            len(tensors) - len(kept),
        )
    return kept


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


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...] | None:
    """The shape a tensor of this name must have in a model of `cfg`; None for unknown names."""
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
    return family_of(cfg.arch).block_shapes(cfg, block_of(name)).get(name.split(".", 2)[2])


def required_tensors(cfg: ModelConfig, start: int, end: int, first: bool, last: bool) -> list[str]:
    """Tensors a stage holding blocks [start, end) cannot do without."""
    names = ["token_embd.weight"] if first else []
    family = family_of(cfg.arch)
    for i in range(start, end):
        names += [f"blk.{i}.{short}" for short in family.required(cfg, i)]
        if cfg.sparse(i):
            names += [expert_name(i, m, e) for e in range(cfg.n_experts) for m in EXPERT_MATRICES]
    if last:
        names += ["output_norm.weight", "token_embd.weight" if cfg.tied_embeddings else "output.weight"]
    return list(dict.fromkeys(names))


def _check_tensors(model: ModelFile) -> None:
    cfg, where = model.config, model.path
    missing = [n for n in required_tensors(cfg, 0, cfg.n_layers, True, True) if n not in model.tensors]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        block, why = block_of(missing[0]), ""
        if block is not None:  # say what the metadata made of the block, beside what the file holds there
            held = ", ".join(sorted(n.split(".", 2)[2] for n in model.tensors if block_of(n) == block)) or "nothing"
            why = f": the metadata makes block {block} {variant(cfg, block)}; the file holds {held} there"
        raise ConfigError(f"{where}: missing tensor '{missing[0]}'{more}{why}")
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
