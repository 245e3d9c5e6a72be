"""Hugging Face folders: safetensors headers (single file or sharded) under canonical names."""

from __future__ import annotations

import json
import logging
import re
import struct
from pathlib import Path

from ..models import Family, family_of, hf_family, require
from . import openai_experts
from .names import EXPERT_MATRICES, expert_name
from .tensors import TensorInfo

log = logging.getLogger("shardwire.formats")

_DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_MAX_HEADER = 100 << 20

# Hugging Face Llama-family parameter names -> the GGUF names used everywhere in shardwire.
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_BLOCK_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate": "ffn_gate_inp",  # a mixture of experts' router (Qwen2-MoE, Qwen3-MoE)
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",  # the expert every token runs (Qwen2-MoE)
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",  # (Mixtral)
}
_BLOCK_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
_PARAM_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
# Qwen3.5's multimodal checkpoints keep the language model under model.language_model
_LANGUAGE_MODEL = "model.language_model."
# One matrix per expert, as transformers saves Qwen3-MoE and Mixtral checkpoints
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w1": "ffn_gate_exps",
    "w3": "ffn_up_exps",
    "w2": "ffn_down_exps",
}
# All experts in one tensor, as transformers 5 holds them in memory: [experts, 2 * ffn, dim] with
# each expert's gate rows before its up rows, and [experts, dim, ffn]
_FUSED_EXPERTS_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class SafetensorsError(ValueError):
    """A safetensors file or Hugging Face folder that cannot be read."""


def canonical_name(hf_name: str, family: Family) -> str | None:
    """The GGUF-style name of a Hugging Face parameter of a model of `family` (whose own names come
    first), or None for parameters we do not use."""
    if hf_name.startswith(_LANGUAGE_MODEL):
        hf_name = "model." + hf_name[len(_LANGUAGE_MODEL) :]
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _BLOCK_RE.match(hf_name)
    names = _BLOCK_NAMES | family.hf_block_names
    if m and m[2] in names:
        return f"blk.{m[1]}.{names[m[2]]}.{m[3]}"
    m = _PARAM_RE.match(hf_name)
    if m and m[2] in family.hf_block_params:
        return f"blk.{m[1]}.{family.hf_block_params[m[2]]}"
    m = _EXPERT_RE.match(hf_name)
    if m and m[4] in _EXPERT_NAMES:
        return expert_name(int(m[1]), _EXPERT_NAMES[m[4]], int(m[3]))
    return None


def canonical_tensors(info: TensorInfo, family: Family) -> dict[str, TensorInfo]:
    """The canonical tensors a Hugging Face tensor holds: none, itself renamed, or (fused experts)
    one matrix per expert."""
    name = info.name
    if name.startswith(_LANGUAGE_MODEL):
        name = "model." + name[len(_LANGUAGE_MODEL) :]
    m = _FUSED_EXPERTS_RE.match(name)
    if m is None:
        name = canonical_name(name, family)
        if name is None:
            return {}
        if name.endswith(".ssm_conv1d.weight") and len(info.shape) == 3 and info.shape[1] == 1:
            # a depthwise Conv1d's [channels, 1, taps]: the same bytes as GGUF's [channels, taps]
            shape = (info.shape[0], info.shape[2])
            info = TensorInfo(info.name, info.dtype, shape, info.path, info.offset, info.nbytes)
        return {name: info.renamed(name)}
    block, experts = int(m[1]), info.split(info.shape[0])
    if m[2] == "down_proj":
        parts = {expert_name(block, "ffn_down_exps", e): t for e, t in enumerate(experts)}
    else:
        parts = {}
        for e, t in enumerate(experts):
            gate, up = t.split(2)
            parts[expert_name(block, "ffn_gate_exps", e)] = gate
            parts[expert_name(block, "ffn_up_exps", e)] = up
    return {name: t.renamed(name) for name, t in parts.items()}


def hf_name(canonical: str, arch: str) -> str:
    """Inverse of canonical_name, for writing Hugging Face files of `arch`."""
    family = family_of(arch)
    for hf, name in _GLOBAL_NAMES.items():
        if name == canonical:
            return hf
    parts = canonical.split(".")
    moe = "block_sparse_moe" if arch == "mixtral" else "mlp"
    if len(parts) == 5:  # blk.N.ffn_gate_exps.E.weight
        kinds = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        kind = dict(zip(EXPERT_MATRICES, kinds))[parts[2]]
        return f"model.layers.{parts[1]}.{moe}.experts.{parts[3]}.{kind}.weight"
    for hf, param in family.hf_block_params.items():
        if canonical == f"blk.{parts[1]}.{param}":
            return f"model.layers.{parts[1]}.{hf}"
    _, layer, short, kind = parts
    names = _BLOCK_NAMES | family.hf_block_names
    hf_short = f"{moe}.gate" if short == "ffn_gate_inp" else {v: k for k, v in names.items()}[short]
    return f"model.layers.{layer}.{hf_short}.{kind}"


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Tensor index of one .safetensors file, keyed by the names in the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw_len = f.read(8)
        if len(raw_len) < 8:
            raise SafetensorsError(f"{path}: truncated safetensors file (no header length)")
        (header_len,) = struct.unpack("<Q", raw_len)
        if header_len > min(_MAX_HEADER, size - 8):
            raise SafetensorsError(f"{path}: safetensors header of {header_len} bytes does not fit in a file of {size}")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsError(f"{path}: safetensors header is not valid JSON ({e})") from None
    base = 8 + header_len
    out: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, (start, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        if dtype not in _DTYPE_SIZES:
            raise SafetensorsError(f"{path}: tensor '{name}' has unsupported dtype {dtype}")
        n = 1
        for d in shape:
            n *= d
        if end - start != n * _DTYPE_SIZES[dtype] or base + end > size:
            raise SafetensorsError(
                f"{path}: tensor '{name}' data [{start}, {end}) does not match "
                f"its shape {list(shape)} {dtype} or the file size {size}"
            )
        out[name] = TensorInfo(name=name, dtype=dtype, shape=shape, path=path, offset=base + start, nbytes=end - start)
    return out


def read_hf_folder(folder: str | Path) -> tuple[dict, dict[str, TensorInfo]]:
    """config.json and the canonical tensor index of a Hugging Face model folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{folder}: not a model folder (no config.json)")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise SafetensorsError(f"{config_path}: invalid JSON ({e})") from None
    family = hf_family(require(config, "model_type", str(config_path)), str(config_path))
    index_path = folder / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = json.loads(index_path.read_text()).get("weight_map", {})
        files = sorted({folder / f for f in weight_map.values()})
    elif (folder / "model.safetensors").is_file():
        files = [folder / "model.safetensors"]
    else:
        raise FileNotFoundError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    stored: dict[str, TensorInfo] = {}
    for file in files:
        if not file.is_file():
            raise FileNotFoundError(f"{file}: shard listed in {index_path.name} is missing")
        stored.update(read_safetensors_header(file))
    tensors: dict[str, TensorInfo] = {}
    try:
        own = openai_experts.experts(stored) if family.hf_experts == "openai" else {}
        for made in own.values():
            tensors.update(made)
        for info in stored.values():
            if info.name not in own:
                tensors.update(canonical_tensors(info, family))
    except ValueError as e:
        raise SafetensorsError(str(e)) from None
    skipped_mtp = sum(name.startswith("mtp.") for name in stored)
    if skipped_mtp:
        log.info(
            "%s: skipping %d multi-token-prediction (mtp.*) tensors: shardwire does not run them", folder, skipped_mtp
        )
    return config, tensors
