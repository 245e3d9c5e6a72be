"""Write models the way the reference tools do: GGUF as llama.cpp's convert_hf_to_gguf.py writes it,
Hugging Face folders as transformers saves them.

Tensors come in under canonical (GGUF) names, float32, in PyTorch (out, in) order with Hugging Face's
rotate-half Q/K rows. K-quants (Q2_K..Q6_K) are encoded here because the gguf package only decodes
them; the formats are ggml's, the scale search is a simpler cousin of ggml-quants.c's.

One file for both formats and the K-quant encoders because they share the tensor naming and
ordering rules; it is test tooling outside the runtime package, read when a format changes.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable

import numpy as np
from gguf import (
    GGML_QUANT_SIZES,
    GGML_QUANT_VERSION,
    QK_K,
    GGMLQuantizationType,
    GGUFEndian,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
)
from gguf import quants as gguf_quants

from shardwire.config import ModelConfig
from shardwire.enums import CODEBOOK_TYPES
from shardwire.formats.names import EXPERT_MATRICES, expert_name
from shardwire.formats.safetensors import hf_name
from shardwire.models import FAMILIES, qwen35

# Each family's declarations (shardwire/models/): the architecture llama.cpp's converter writes,
# whether it interleaves Q/K rows, transformers' class and model_type
GGUF_ARCH = {arch: f.converter_archs.get(arch, arch) for f in FAMILIES for arch in f.archs}
PERMUTED_ARCHS = tuple(arch for f in FAMILIES for arch in f.archs if GGUF_ARCH[arch] in f.qk_interleaved)
HYBRID_ARCHS = qwen35.ARCHS
_HF_CLASSES = {arch: cls for f in FAMILIES for arch, cls in f.hf_classes.items()}
_HF_MODEL_TYPES = {arch: model_type for f in FAMILIES for model_type, arch in f.hf_types.items()}
# Tensors the converter keeps in float32 whatever the file type (llama-quantize skips them too)
KEPT_F32 = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight")

_FILE_TYPES = {
    "F32": LlamaFileType.ALL_F32,
    "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q5_0": LlamaFileType.MOSTLY_Q5_0,
    "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K,
    "Q3_K": LlamaFileType.MOSTLY_Q3_K_S,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S,
    "Q5_K": LlamaFileType.MOSTLY_Q5_K_S,
    "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "IQ1_S": LlamaFileType.MOSTLY_IQ1_S,
    "IQ1_M": LlamaFileType.MOSTLY_IQ1_M,
    "IQ2_XXS": LlamaFileType.MOSTLY_IQ2_XXS,
    "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS,
    "IQ2_S": LlamaFileType.MOSTLY_IQ2_S,
    "IQ3_XXS": LlamaFileType.MOSTLY_IQ3_XXS,
    "IQ3_S": LlamaFileType.MOSTLY_IQ3_S,
    "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS,
    "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
}
WEIGHT_TYPES = tuple(_FILE_TYPES)


# ---------------------------------------------------------------------------------------------
# Q/K row order and rope factors


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows (head, 2, pair) -> interleaved (head, pair, 2)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(cfg: ModelConfig) -> np.ndarray:
    """rope_freqs.weight for Llama 3.1 scaling, computed as convert_hf_to_gguf.py does.

    The converter reads original_max_position_embeddings from the top level of config.json, where
    real Llama 3.1 configs do not have it, so it always uses 8192; we take the value from the
    rope scaling itself, which is what transformers uses (and is 8192 for every Llama 3.x).
    """
    s = cfg.rope_scaling
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    factor, low, high = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_context = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_context / low, old_context / high
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def gguf_config(cfg: ModelConfig) -> ModelConfig:
    """The config shardwire reads back from a GGUF written for `cfg`: Mistral is stored as llama,
    Llama 3.1 scaling lives in rope_freqs.weight rather than in the metadata, and GGUF keeps
    epsilon, theta and scaling factor as float32."""
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    scaling = None
    if cfg.rope_scaling and cfg.rope_scaling.get("type") == "linear":
        scaling = {"type": "linear", "factor": f32(cfg.rope_scaling["factor"])}
    return ModelConfig.from_dict(
        {
            **cfg.to_dict(),
            "arch": GGUF_ARCH[cfg.arch],
            # llama.cpp renormalizes the chosen experts' weights of these architectures, Qwen2-MoE's not
            "expert_norm": cfg.arch != "qwen2moe",
            "rope_scaling": scaling,
            "norm_eps": f32(cfg.norm_eps),
            "rope_theta": f32(cfg.rope_theta),
            "hf_layout": False,  # the converter's form: norms 1 + w, A = -exp(A_log), value heads tiled
        }
    )


# ---------------------------------------------------------------------------------------------
# K-quant encoders. Each takes float32 blocks of QK_K values, shape (n, 256), and returns the
# packed bytes, shape (n, type_size), in the layout ggml (and gguf.quants.dequantize) reads.


def _f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b != 0, a / np.where(b != 0, b, 1), 0).astype(np.float32)


def _affine_fit(x, w, nmax: int, steps=np.arange(-0.5, 1.01, 0.25, dtype=np.float32)):
    """Per sub-block (last axis): scale >= 0 and offset <= 0 with x ~ scale * q + offset, q in [0, nmax].

    Tries a range of grid spacings around (max - min) / nmax and keeps, for each, the weighted
    least-squares scale and offset of the resulting integers.
    """
    lo = np.minimum(x.min(-1, keepdims=True), 0)
    span = x.max(-1, keepdims=True) - lo
    best_scale, best_off = span / nmax, lo
    q = np.clip(np.rint(_divide(np.float32(nmax), span) * (x - lo)), 0, nmax)
    best_err = (w * (best_scale * q + best_off - x) ** 2).sum(-1, keepdims=True)
    sw = w.sum(-1, keepdims=True)
    sx = (w * x).sum(-1, keepdims=True)
    for step in steps:
        q = np.clip(np.rint(_divide(nmax + step, span) * (x - lo)), 0, nmax)
        sq, sqq, sqx = (
            (w * q).sum(-1, keepdims=True),
            (w * q * q).sum(-1, keepdims=True),
            (w * q * x).sum(-1, keepdims=True),
        )
        det = sw * sqq - sq * sq
        scale, off = _divide(sw * sqx - sq * sx, det), _divide(sqq * sx - sq * sqx, det)
        # ggml stores the offset as -dmin * m with m >= 0, so a positive offset becomes 0; so does
        # an offset the integers cannot determine (all of them equal where the weights are not 0).
        fixed = (off > 0) | (det <= 1e-6 * sw * sqq)
        scale, off = np.where(fixed, _divide(sqx, sqq), scale), np.where(fixed, 0, off)
        err = (w * (scale * q + off - x) ** 2).sum(-1, keepdims=True)
        better = (err < best_err) & (scale >= 0)
        best_scale, best_off = np.where(better, scale, best_scale), np.where(better, off, best_off)
        best_err = np.where(better, err, best_err)
    return best_scale, best_off


def _symmetric_fit(x, w, nmax: int, steps=np.arange(-0.6, 0.61, 0.2, dtype=np.float32)):
    """Per sub-block: a signed scale with x ~ scale * q, q in [-nmax, nmax - 1]."""
    peak = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    best_scale = _divide(peak, -np.float32(nmax))
    q = np.clip(np.rint(_divide(-np.float32(nmax), peak) * x), -nmax, nmax - 1)
    best_err = (w * (best_scale * q - x) ** 2).sum(-1, keepdims=True)
    for step in steps:
        q = np.clip(np.rint(_divide(-np.float32(nmax + step), peak) * x), -nmax, nmax - 1)
        scale = _divide((w * q * x).sum(-1, keepdims=True), (w * q * q).sum(-1, keepdims=True))
        err = (w * (scale * q - x) ** 2).sum(-1, keepdims=True)
        better = err < best_err
        best_scale, best_err = np.where(better, scale, best_scale), np.where(better, err, best_err)
    return best_scale


def _affine_superblocks(blocks, sub: int, nmax: int, levels: int, weights):
    """Sub-block scales/offsets quantized to `levels` steps of two f16 super-block scales."""
    x = blocks.reshape(len(blocks), QK_K // sub, sub)
    scale, off = _affine_fit(x, weights(x), nmax)
    d = _f16(scale.max(1, keepdims=True) / levels)
    dmin = _f16((-off).max(1, keepdims=True) / levels)
    sc = np.clip(np.rint(_divide(scale, d)), 0, levels)
    m = np.clip(np.rint(_divide(-off, dmin)), 0, levels)
    q = np.clip(np.rint(_divide(x + dmin * m, d * sc)), 0, nmax)
    as_u8 = lambda a: a.reshape(len(blocks), -1).astype(np.uint8)  # noqa: E731
    return d.reshape(-1, 1), dmin.reshape(-1, 1), as_u8(sc), as_u8(m), as_u8(q)


def _symmetric_superblocks(blocks, nmax: int, levels: int):
    x = blocks.reshape(len(blocks), QK_K // 16, 16)
    scale = _symmetric_fit(x, x * x, nmax)
    d = _f16(np.abs(scale).max(1, keepdims=True) / levels)
    sc = np.clip(np.rint(_divide(scale, d)), -levels, levels)
    q = np.clip(np.rint(_divide(x, d * sc)), -nmax, nmax - 1)
    return d.reshape(-1, 1), sc.reshape(len(blocks), -1).astype(np.int8), q.reshape(len(blocks), -1)


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return d.astype(np.float16).view(np.uint8)


def _or_bits(values: np.ndarray, shifts, axis: int) -> np.ndarray:
    """Pack small fields along `axis` into one byte: sum of values[i] << shifts[i] (no overlaps)."""
    shape = [1] * values.ndim
    shape[axis] = len(shifts)
    return (values.astype(np.uint8) << np.array(shifts, dtype=np.uint8).reshape(shape)).sum(axis=axis, dtype=np.uint8)


def _nibbles_q4k(q: np.ndarray) -> np.ndarray:
    """Each 64 values: the first 32 in low nibbles, the next 32 in high nibbles of 32 bytes."""
    q = (q & 0xF).reshape(len(q), 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(len(q), 128)


def _crumbs(q: np.ndarray) -> np.ndarray:
    """Two-bit values: each 128-value half in 32 bytes, four groups of 32 at shifts 0, 2, 4, 6."""
    return _or_bits((q & 3).reshape(len(q), 2, 4, 32), [0, 2, 4, 6], axis=2).reshape(len(q), 64)


def _scales_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins in 12 bytes (ggml's get_scale_min_k4 layout)."""
    out = np.empty((len(sc), 12), dtype=np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return out


def _rms_plus_abs(x):
    return np.sqrt((x * x).mean(-1, keepdims=True)) + np.abs(x)


def quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_superblocks(blocks, 16, 3, 15, np.abs)
    return np.concatenate([sc | (m << 4), _crumbs(q), _f16_bytes(d), _f16_bytes(dmin)], axis=1)


def quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric_superblocks(blocks, 4, 31)
    v = (q + 4).astype(np.uint8)
    hmask = _or_bits((v >> 2).reshape(len(v), 8, 32), range(8), axis=1)
    s6 = (sc.astype(np.int16) + 32).astype(np.uint8)
    scales = np.concatenate(
        [(s6[:, :8] & 0xF) | ((s6[:, 8:] & 0xF) << 4), _or_bits((s6 >> 4).reshape(len(v), 4, 4), [0, 2, 4, 6], axis=1)],
        axis=1,
    )
    return np.concatenate([hmask, _crumbs(v), scales, _f16_bytes(d)], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_superblocks(blocks, 32, 15, 63, _rms_plus_abs)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, m), _nibbles_q4k(q)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    d, dmin, sc, m, q = _affine_superblocks(blocks, 32, 31, 63, _rms_plus_abs)
    qh = _or_bits((q >> 4).reshape(len(q), 8, 32), range(8), axis=1)
    return np.concatenate([_f16_bytes(d), _f16_bytes(dmin), _scales_k4(sc, m), qh, _nibbles_q4k(q)], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    d, sc, q = _symmetric_superblocks(blocks, 32, 127)
    q6 = (q + 32).astype(np.uint8).reshape(len(q), 2, 2, 64)
    ql = ((q6[:, :, 0] & 0xF) | ((q6[:, :, 1] & 0xF) << 4)).reshape(len(q), 128)
    qh = _or_bits((q6.reshape(len(q), 2, 4, 32) >> 4) & 3, [0, 2, 4, 6], axis=2).reshape(len(q), 64)
    return np.concatenate([ql, qh, sc.view(np.uint8), _f16_bytes(d)], axis=1)


_K_QUANTIZERS = {
    GGMLQuantizationType.Q2_K: quantize_q2_k,
    GGMLQuantizationType.Q3_K: quantize_q3_k,
    GGMLQuantizationType.Q4_K: quantize_q4_k,
    GGMLQuantizationType.Q5_K: quantize_q5_k,
    GGMLQuantizationType.Q6_K: quantize_q6_k,
}


def _quantized_by_ggml(rows: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Rows encoded by ggml's own quantizer (the one llama-quantize calls). The types that need an
    importance matrix get every column weighted alike: these files test reading, not quality."""
    from shardwire._ggml import ggml  # built by shardwire's install; the codebook types need it

    n, k = rows.shape
    block, type_size = GGML_QUANT_SIZES[qtype]
    out = np.empty((n, k // block * type_size), dtype=np.uint8)
    importance = np.ones(k, dtype=np.float32) if ggml.ggml_quantize_requires_imatrix(int(qtype)) else None
    as_floats = ctypes.POINTER(ctypes.c_float)
    ggml.ggml_quantize_chunk(
        int(qtype),
        rows.ctypes.data_as(as_floats),
        out.ctypes.data_as(ctypes.c_void_p),
        0,
        n,
        k,
        None if importance is None else importance.ctypes.data_as(as_floats),
    )
    return out


def quantize(data: np.ndarray, type_name: str) -> tuple[np.ndarray, GGMLQuantizationType]:
    """Encode a float32 array as GGML type `type_name` (rows along the last axis).

    Returns the encoded array and the type actually used: rows that are not a whole number of
    blocks fall back to F16, as convert_hf_to_gguf.py does.
    """
    qtype = GGMLQuantizationType[type_name]
    block, type_size = GGML_QUANT_SIZES[qtype]
    data = np.ascontiguousarray(data, dtype=np.float32)
    if data.shape[-1] % block:
        qtype = GGMLQuantizationType.F16
    if qtype.name in CODEBOOK_TYPES:
        return _quantized_by_ggml(data.reshape(-1, data.shape[-1]), qtype).reshape(*data.shape[:-1], -1), qtype
    if qtype in _K_QUANTIZERS:
        blocks = data.reshape(-1, QK_K)
        # A few thousand blocks at a time keeps the search's temporaries small.
        encoded = np.concatenate([_K_QUANTIZERS[qtype](blocks[i : i + 4096]) for i in range(0, len(blocks), 4096)])
        return encoded.reshape(*data.shape[:-1], data.shape[-1] // block * type_size), qtype
    return gguf_quants.quantize(data, qtype), qtype


# ---------------------------------------------------------------------------------------------
# GGUF


def _stored_names(cfg: ModelConfig, tensors: dict) -> list[str]:
    """Embedding, blocks in order, final norm and head; no output.weight when it is tied."""

    def order(name: str):
        parts = name.split(".")
        if parts[0] == "blk":
            return 1, int(parts[1]), name
        return (0 if name == "token_embd.weight" else 2), 0, name

    return [n for n in sorted(tensors, key=order) if not (n == "output.weight" and cfg.tied_embeddings)]


def _stacked_experts(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One matrix per expert (blk.N.ffn_gate_exps.E.weight) -> the converter's 3-D tensor per block."""
    out = {}
    for name, w in tensors.items():
        parts = name.split(".")
        if len(parts) == 5 and parts[2] in EXPERT_MATRICES:
            if parts[3] == "0":
                block, matrix = int(parts[1]), parts[2]
                stacked = [tensors[expert_name(block, matrix, e)] for e in range(cfg.n_experts)]
                out[f"blk.{block}.{matrix}.weight"] = np.stack(stacked)
        else:
            out[name] = w
    return out


def _tiled_v_heads(cfg: ModelConfig, w: np.ndarray, axis: int, width: int) -> np.ndarray:
    """The converter's _LinearAttentionVReorderBase: value heads grouped by key head -> tiled."""
    r = cfg.ssm_v_heads // cfg.ssm_k_heads
    shape = w.shape
    split = shape[:axis] + (cfg.ssm_k_heads, r, width) + shape[axis + 1 :]
    return np.ascontiguousarray(np.swapaxes(w.reshape(split), axis, axis + 1)).reshape(shape)


def _converted_hybrid(cfg: ModelConfig, name: str, w: np.ndarray) -> tuple[str, np.ndarray]:
    """A Qwen3.5 tensor as convert_hf_to_gguf.py writes it: norms + 1 (but the delta-net's own),
    A_log -> -exp(A_log), value heads tiled, the pre-FFN norm named post_attention_norm."""
    if name.endswith("norm.weight") and not name.endswith("ssm_norm.weight"):
        w = w + 1
    qk = 2 * cfg.ssm_k_heads * cfg.ssm_k_dim
    short = name.split(".", 2)[-1]
    if short in ("attn_qkv.weight", "ssm_conv1d.weight"):
        w = np.concatenate([w[:qk], _tiled_v_heads(cfg, w[qk:], 0, cfg.ssm_v_dim)])
    elif short == "attn_gate.weight":
        w = _tiled_v_heads(cfg, w, 0, cfg.ssm_v_dim)
    elif short in ("ssm_beta.weight", "ssm_alpha.weight", "ssm_dt.bias"):
        w = _tiled_v_heads(cfg, w, 0, 1)
    elif short == "ssm_a":
        w = _tiled_v_heads(cfg, -np.exp(w), 0, 1)
    elif short == "ssm_out.weight":
        w = _tiled_v_heads(cfg, w, 1, cfg.ssm_v_dim)
    elif short == "ffn_norm.weight":
        name = name.replace(".ffn_norm.", ".post_attention_norm.")
    return name, w.astype(np.float32)


def _gguf_tensors(cfg: ModelConfig, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Canonical HF-order tensors -> what the converter stores, in its order."""
    out: dict[str, np.ndarray] = {}
    if cfg.rope_scaling and cfg.rope_scaling.get("type") == "llama3":
        out["rope_freqs.weight"] = llama3_rope_factors(cfg)
    tensors = _stacked_experts(cfg, tensors)
    for name in _stored_names(cfg, tensors):
        w = np.asarray(tensors[name], dtype=np.float32)
        if cfg.arch in PERMUTED_ARCHS and name.endswith((".attn_q.weight", ".attn_q.bias")):
            w = permute_qk(w, cfg.n_heads)
        elif cfg.arch in PERMUTED_ARCHS and name.endswith((".attn_k.weight", ".attn_k.bias")):
            w = permute_qk(w, cfg.n_kv_heads)
        elif cfg.arch in HYBRID_ARCHS:
            name, w = _converted_hybrid(cfg, name, w)
        out[name] = w
    return out


class _Writer(GGUFWriter):
    """GGUFWriter with vectorized packing of long arrays: it packs item by item, which takes
    seconds for a 150k-token vocabulary."""

    _NUMPY = {GGUFValueType.INT32: "<i4", GGUFValueType.UINT32: "<u4", GGUFValueType.FLOAT32: "<f4"}

    def _pack_val(self, val, vtype, add_vtype, sub_type=None) -> bytes:
        if vtype != GGUFValueType.ARRAY or len(val) < 256 or self.endianess != GGUFEndian.LITTLE:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        ltype = sub_type or GGUFValueType.get_type(val[0])
        if ltype == GGUFValueType.STRING and all(isinstance(v, str) for v in val):
            encoded = [v.encode("utf-8") for v in val]
            body = b"".join(struct.pack("<Q", len(e)) + e for e in encoded)
        elif ltype in self._NUMPY and all(GGUFValueType.get_type(v) == ltype for v in val):
            body = np.asarray(val, dtype=self._NUMPY[ltype]).tobytes()
        else:
            return super()._pack_val(val, vtype, add_vtype, sub_type)
        head = struct.pack("<I", vtype) if add_vtype else b""
        return head + struct.pack("<IQ", ltype, len(val)) + body


def _add_metadata_value(writer: GGUFWriter, key: str, value) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        (writer.add_uint32 if value >= 0 else writer.add_int32)(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        writer.add_array(key, list(value))
    else:
        raise TypeError(f"GGUF metadata '{key}': cannot store a {type(value).__name__}")


def _add_model_metadata(writer: GGUFWriter, cfg: ModelConfig, name: str, weight_type: str) -> None:
    arch = writer.arch
    writer.add_type("model")
    writer.add_name(name)
    writer.add_block_count(cfg.n_layers)
    writer.add_context_length(cfg.context_length)
    writer.add_embedding_length(cfg.dim)
    if cfg.arch != "qwen35moe":  # its config.json has no intermediate_size for the converter to write
        writer.add_feed_forward_length(cfg.ffn_dim)
    writer.add_head_count(cfg.n_heads)
    writer.add_head_count_kv(cfg.n_kv_heads)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.norm_eps)
    # The converter writes these whenever config.json has head_dim, which Qwen3's always has.
    if cfg.head_dim * cfg.n_heads != cfg.dim or cfg.arch in ("qwen3", "qwen3moe", *HYBRID_ARCHS):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    writer.add_file_type(_FILE_TYPES[weight_type])
    writer.add_uint32(f"{arch}.vocab_size", cfg.vocab_size)
    writer.add_rope_dimension_count(cfg.rope_dim or cfg.head_dim)
    if cfg.arch in HYBRID_ARCHS:
        _add_hybrid_metadata(writer, cfg)
    if cfg.n_experts:
        writer.add_expert_count(cfg.n_experts)
        writer.add_expert_used_count(cfg.n_experts_used)
        if arch != "llama":  # Mixtral's size of an expert is its feed-forward length
            writer.add_expert_feed_forward_length(cfg.expert_ffn_dim)
        if cfg.shared_expert_ffn_dim:
            writer.add_expert_shared_feed_forward_length(cfg.shared_expert_ffn_dim)
    if cfg.rope_scaling and cfg.rope_scaling.get("type") == "linear":
        writer.add_string(f"{arch}.rope.scaling.type", "linear")
        writer.add_rope_scaling_factor(cfg.rope_scaling["factor"])
    writer.add_quantization_version(GGML_QUANT_VERSION)


def _add_hybrid_metadata(writer: GGUFWriter, cfg: ModelConfig) -> None:
    """Qwen3NextModel's and _Qwen35MRopeMixin's keys in convert_hf_to_gguf.py: the delta-net blocks
    as a full_attention_interval where one describes them, else (as today's converter writes every
    such file) a flag per block in attention.recurrent_layers."""
    full = [b for b in range(cfg.n_layers) if not cfg.linear(b)]
    interval = full[0] + 1 if full else cfg.n_layers + 1
    if cfg.linear_blocks == tuple(b for b in range(cfg.n_layers) if (b + 1) % interval):
        writer.add_full_attention_interval(interval)
    else:
        writer.add_array(f"{cfg.arch}.attention.recurrent_layers", [cfg.linear(b) for b in range(cfg.n_layers)])
    writer.add_ssm_conv_kernel(cfg.ssm_conv_kernel)
    writer.add_ssm_state_size(cfg.ssm_k_dim)
    writer.add_ssm_group_count(cfg.ssm_k_heads)
    writer.add_ssm_time_step_rank(cfg.ssm_v_heads)
    writer.add_ssm_inner_size(cfg.ssm_v_dim * cfg.ssm_v_heads)
    pairs = (cfg.rope_dim or cfg.head_dim) // 2  # M-RoPE sections (t, h, w, e) in the ratio of [11, 11, 10, 0]
    t = pairs * 11 // 32
    writer.add_rope_dimension_sections([t, t, pairs - 2 * t, 0])


def _check_type(name: str) -> str:
    if name not in WEIGHT_TYPES:
        raise ValueError(f"unsupported weight type {name!r} (supported: {', '.join(WEIGHT_TYPES)})")
    return name


def write_gguf(
    path: str | Path,
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    tokenizer_metadata: dict,
    *,
    weight_type: str = "F32",
    type_for: Callable[[str, tuple], str] | None = None,
    name: str = "shardwire-test",
    split_max_tensors: int | None = None,
) -> list[Path]:
    """Write a GGUF model (or the parts `stem-0000i-of-0000N.gguf` of a split one).

    Matrices get `weight_type`, or `type_for(name, shape)` when given; 1-D tensors stay F32.
    Files appear atomically: everything is written in a scratch folder beside `path`, then renamed.
    Returns the paths written, first part first.
    """
    path = Path(path)
    _check_type(weight_type)
    writer_tensors = _gguf_tensors(cfg, tensors)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{path.stem}-", dir=path.parent))
    try:
        writer = _Writer(scratch / path.name, GGUF_ARCH[cfg.arch], split_max_tensors=split_max_tensors or 0)
        _add_model_metadata(writer, cfg, name, weight_type)
        for key, value in tokenizer_metadata.items():
            _add_metadata_value(writer, key, value)
        for tensor_name, w in writer_tensors.items():
            if w.ndim < 2 or tensor_name.endswith(KEPT_F32):
                writer.add_tensor(tensor_name, w)
                continue
            wanted = _check_type(type_for(tensor_name, w.shape) if type_for else weight_type)
            data, qtype = quantize(w, wanted)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        written = sorted(scratch.iterdir())
        final = [path.parent / p.name for p in written]
        for src, dst in zip(written, final):
            os.replace(src, dst)
        return final
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Hugging Face folders


def _token_ids(tokenizer_json: str | None, *tokens) -> list[int | None]:
    """Ids of tokens (strings or {"content": ...} entries of tokenizer_config.json) in tokenizer.json."""
    if tokenizer_json is None:
        return [None] * len(tokens)
    spec = json.loads(tokenizer_json)
    vocab = spec.get("model", {}).get("vocab", {})
    ids = dict(vocab) if isinstance(vocab, dict) else {}
    ids.update({a["content"]: a["id"] for a in spec.get("added_tokens", [])})
    return [ids.get(t.get("content") if isinstance(t, dict) else t) for t in tokens]


def hf_config(
    cfg: ModelConfig,
    tensors: dict | None = None,
    *,
    dtype: str = "float32",
    bos_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> dict:
    """config.json as transformers saves it for this architecture (rope_theta / rope_scaling as in
    the Hub's Llama 3.1, Mistral and Qwen configs; transformers 5 reads both these and rope_parameters)."""
    if cfg.arch in ("qwen2", "qwen2moe") and cfg.head_dim * cfg.n_heads != cfg.dim:
        raise ValueError("Qwen2 configs have no head_dim: head_dim must be hidden_size / num_attention_heads")
    rope_scaling = None
    if cfg.rope_scaling:
        kind = cfg.rope_scaling["type"]
        rope_scaling = {"rope_type": kind, **{k: v for k, v in cfg.rope_scaling.items() if k != "type"}}
    out = {
        "architectures": [_HF_CLASSES[cfg.arch]],
        "model_type": _HF_MODEL_TYPES[cfg.arch],
        "attention_dropout": 0.0,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "hidden_act": "silu",
        "hidden_size": cfg.dim,
        "initializer_range": 0.02,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.context_length,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "rms_norm_eps": cfg.norm_eps,
        "rope_scaling": rope_scaling,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tied_embeddings,
        "torch_dtype": dtype,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }
    if cfg.arch not in ("qwen2", "qwen2moe"):
        out["head_dim"] = cfg.head_dim
    if cfg.arch in ("llama", "qwen3", "qwen3moe"):
        out["attention_bias"] = any(n.endswith(".attn_q.bias") for n in tensors or ())
    if cfg.arch == "llama":
        out.update(mlp_bias=False, pretraining_tp=1)
    if cfg.arch in ("mistral", "mixtral"):
        out["sliding_window"] = None
    if cfg.arch in ("qwen2", "qwen2moe", "qwen3", "qwen3moe"):
        out.update(max_window_layers=cfg.n_layers, sliding_window=None, use_sliding_window=False)
    if cfg.arch == "mixtral":
        out.update(num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.n_experts_used)
        out["intermediate_size"] = cfg.expert_ffn_dim
    if cfg.arch == "qwen2moe":
        out.update(qkv_bias=True, shared_expert_intermediate_size=cfg.shared_expert_ffn_dim)
    if cfg.arch in HYBRID_ARCHS:
        _hybrid_hf_config(cfg, out)
    if cfg.arch in ("qwen2moe", "qwen3moe"):
        out.update(
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.n_experts_used,
            moe_intermediate_size=cfg.expert_ffn_dim,
            norm_topk_prob=cfg.expert_norm,
            decoder_sparse_step=1,
            mlp_only_layers=list(cfg.dense_blocks),
        )
    return dict(sorted(out.items()))


def _hybrid_hf_config(cfg: ModelConfig, out: dict) -> None:
    """Qwen3_5TextConfig / Qwen3_5MoeTextConfig as transformers saves them."""
    for key in ("rope_scaling", "rope_theta", "max_window_layers", "sliding_window", "use_sliding_window"):
        out.pop(key, None)
    rotary = (cfg.rope_dim or cfg.head_dim) / cfg.head_dim
    pairs = (cfg.rope_dim or cfg.head_dim) // 2
    t = pairs * 11 // 32
    out.update(
        attention_bias=False,
        head_dim=cfg.head_dim,
        layer_types=["linear_attention" if cfg.linear(i) else "full_attention" for i in range(cfg.n_layers)],
        linear_conv_kernel_dim=cfg.ssm_conv_kernel,
        linear_key_head_dim=cfg.ssm_k_dim,
        linear_value_head_dim=cfg.ssm_v_dim,
        linear_num_key_heads=cfg.ssm_k_heads,
        linear_num_value_heads=cfg.ssm_v_heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": cfg.rope_theta,
            "partial_rotary_factor": rotary,
            "mrope_section": [t, t, pairs - 2 * t],
            "mrope_interleaved": True,
        },
    )
    if cfg.arch == "qwen35moe":
        del out["intermediate_size"]
        out.update(
            num_experts=cfg.n_experts,
            num_experts_per_tok=cfg.n_experts_used,
            moe_intermediate_size=cfg.expert_ffn_dim,
            shared_expert_intermediate_size=cfg.shared_expert_ffn_dim,
        )


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def write_hf(
    folder: str | Path,
    cfg: ModelConfig,
    tensors: dict[str, np.ndarray],
    *,
    tokenizer_json: str | None = None,
    tokenizer_config: dict | None = None,
    dtype: str = "float32",
    shard_max_tensors: int | None = None,
) -> Path:
    """Write config.json, model.safetensors (or shards plus model.safetensors.index.json) and, when
    given, tokenizer.json and tokenizer_config.json."""
    import torch
    from safetensors.torch import save_file

    torch_dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf = {
        hf_name(n, cfg.arch): torch.from_numpy(np.asarray(tensors[n], dtype=np.float32)).to(torch_dtype).contiguous()
        for n in _stored_names(cfg, tensors)
    }
    for name, t in hf.items():
        if name.endswith("linear_attn.conv1d.weight"):  # a depthwise Conv1d: [channels, 1, taps]
            hf[name] = t[:, None]

    groups = [list(hf)]
    if shard_max_tensors:
        keys = list(hf)
        groups = [keys[i : i + shard_max_tensors] for i in range(0, len(keys), shard_max_tensors)]
    if len(groups) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    for file, group in zip(files, groups):
        tmp = folder / f".{file}.tmp"
        save_file({k: hf[k] for k in group}, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, folder / file)
    if len(groups) > 1:
        index = {
            "metadata": {"total_size": sum(t.numel() * t.element_size() for t in hf.values())},
            "weight_map": {k: file for file, group in zip(files, groups) for k in group},
        }
        _atomic_write_text(folder / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")

    tokenizer_config = dict(tokenizer_config or {})
    if tokenizer_json is not None:
        _atomic_write_text(folder / "tokenizer.json", tokenizer_json)
    if tokenizer_config:
        _atomic_write_text(folder / "tokenizer_config.json", json.dumps(tokenizer_config, indent=2) + "\n")
    bos, eos = _token_ids(tokenizer_json, tokenizer_config.get("bos_token"), tokenizer_config.get("eos_token"))
    # config.json goes last: a folder that has one is complete.
    config = hf_config(cfg, tensors, dtype=dtype, bos_token_id=bos, eos_token_id=eos)
    _atomic_write_text(folder / "config.json", json.dumps(config, indent=2) + "\n")
    return folder
