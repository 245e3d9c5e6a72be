"""glassllm's pretrained model (PyPI `glassllm`, MIT) as a GGUF file or a Hugging Face folder.

A 4-block Llama (RMSNorm, GQA, SwiGLU, tied embeddings) trained on Alice in Wonderland: a real
trained model small enough for CI, whose greedy continuations must equal glassllm's own.
glassllm multiplies activations by (in, out) matrices and rotates adjacent pairs (x[2i], x[2i+1])
for RoPE; Hugging Face Llama uses (out, in) weights and rotate-half pairs (x[i], x[i + d/2]), so
Q/K rows are regrouped the way transformers' convert_llama_weights_to_hf.py does for Meta's
checkpoints. Its tokenizer is character BPE over NFC text with spaces as U+2581.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from shardwire.config import ModelConfig
from shardwire.pipeline.loading import undo_qk_interleave
from shardwire.weights.cache import default_cache_dir

from .writer import write_gguf, write_hf

SPACE = "\u2581"
CHUNK_REGEX = "\n|\u2581*[^\u2581\n]+|\u2581+"  # glassllm.tokenizer._CHUNK
UNK_TEXT = "\u2047"  # what glassllm's decode shows for <unk>
_SPECIAL_TYPES = {"<pad>": 3, "<unk>": 2, "<bos>": 3, "<eos>": 3}  # GGUF token types: control, unknown


def load(lang: str = "en"):
    import glassllm

    return glassllm.load_pretrained(lang)


def model_config(model) -> ModelConfig:
    gcfg = model.cfg
    return ModelConfig(
        arch="llama",
        n_layers=gcfg.n_layers,
        dim=gcfg.d_model,
        n_heads=gcfg.n_heads,
        n_kv_heads=gcfg.n_kv_heads,
        head_dim=gcfg.d_model // gcfg.n_heads,
        ffn_dim=model.blocks[0].ffn.W1.data.shape[1],
        vocab_size=gcfg.vocab_size,
        norm_eps=float(gcfg.eps),
        rope_theta=float(gcfg.rope_base),
        context_length=gcfg.max_len,
        tied_embeddings=True,
    )


def model_tensors(model, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """glassllm parameters -> canonical names, (out, in) order, rotate-half Q/K rows."""
    f32 = lambda t: np.ascontiguousarray(t.data, dtype=np.float32)  # noqa: E731
    out = {"token_embd.weight": f32(model.E), "output_norm.weight": f32(model.norm_f.gamma)}
    for i, block in enumerate(model.blocks):
        p, attn, ffn = f"blk.{i}.", block.attn, block.ffn
        out[p + "attn_norm.weight"] = f32(block.norm1.gamma)
        # Interleaved pairs are exactly llama.cpp's GGUF row order, so the GGUF loaders' inverse
        # permutation turns them into rotate-half order.
        out[p + "attn_q.weight"] = undo_qk_interleave(f32(attn.W_Q).T, cfg.n_heads)
        out[p + "attn_k.weight"] = undo_qk_interleave(f32(attn.W_K).T, cfg.n_kv_heads)
        out[p + "attn_v.weight"] = f32(attn.W_V).T
        out[p + "attn_output.weight"] = f32(attn.W_O).T
        out[p + "ffn_norm.weight"] = f32(block.norm2.gamma)
        out[p + "ffn_gate.weight"] = f32(ffn.W1).T
        out[p + "ffn_up.weight"] = f32(ffn.W3).T
        out[p + "ffn_down.weight"] = f32(ffn.W2).T
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def tokenizer_json(tok) -> str:
    """glassllm's tokenizer as a Hugging Face tokenizer.json: same ids for every text, same decode.

    glassllm never reads special tokens out of text ("<bos>" is five characters, two of them
    unknown), so they are plain vocabulary entries here, not added tokens; the decoder drops
    them and shows <unk> as glassllm does.
    """
    specials = [
        {"type": "Replace", "pattern": {"String": t}, "content": UNK_TEXT if t == "<unk>" else ""}
        for t in ("<pad>", "<unk>", "<bos>", "<eos>")
    ]
    spec = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [],
        "normalizer": {
            "type": "Sequence",
            "normalizers": [{"type": "NFC"}, {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}],
        },
        "pre_tokenizer": {"type": "Split", "pattern": {"Regex": CHUNK_REGEX}, "behavior": "Isolated", "invert": False},
        "post_processor": None,
        "decoder": {
            "type": "Sequence",
            "decoders": [*specials, {"type": "Replace", "pattern": {"String": SPACE}, "content": " "}],
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(tok.token_to_id),
            "merges": [list(pair) for pair in tok.merges],
        },
    }
    return json.dumps(spec, ensure_ascii=False)


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 128,
        "split_special_tokens": True,
    }  # like glassllm: "<bos>" in text is text


def gguf_tokenizer_metadata(tok, hf_json: str) -> dict:
    """A SentencePiece-style ("llama") vocabulary llama.cpp can load, merged tokens scored by -rank,
    plus the exact tokenizer as tokenizer.huggingface.json."""
    n_plain = len(tok.vocab) - len(tok.merges)
    scores = [0.0] * n_plain + [-float(rank) for rank in range(len(tok.merges))]
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": list(tok.vocab),
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": [_SPECIAL_TYPES.get(t, 1) for t in tok.vocab],
        "tokenizer.ggml.bos_token_id": tok.token_to_id["<bos>"],
        "tokenizer.ggml.eos_token_id": tok.token_to_id["<eos>"],
        "tokenizer.ggml.unknown_token_id": tok.token_to_id["<unk>"],
        "tokenizer.ggml.padding_token_id": tok.token_to_id["<pad>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
        "tokenizer.huggingface.json": hf_json,
    }


_HF_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16"}


def convert_glassllm(out: str | Path, fmt: str, lang: str = "en", weight_type: str = "F16") -> Path:
    """Write glassllm's `lang` model as a GGUF file (`out` is the file) or a Hugging Face folder
    (`out` is the folder). glassllm ships fp16 weights, so F16 loses nothing."""
    model, tok = load(lang)
    cfg = model_config(model)
    tensors = model_tensors(model, cfg)
    hf_json = tokenizer_json(tok)
    out = Path(out)
    if fmt == "gguf":
        return write_gguf(
            out, cfg, tensors, gguf_tokenizer_metadata(tok, hf_json), weight_type=weight_type, name=f"glassllm-{lang}"
        )[0]
    if fmt == "hf":
        if weight_type not in _HF_DTYPES:
            raise ValueError(f"a Hugging Face folder stores F32, F16 or BF16, not {weight_type}")
        return write_hf(
            out,
            cfg,
            tensors,
            tokenizer_json=hf_json,
            tokenizer_config=tokenizer_config(),
            dtype=_HF_DTYPES[weight_type],
        )
    raise ValueError(f"unknown format {fmt!r} (gguf or hf)")


def cached_glassllm_gguf(cache_dir: str | Path | None = None, lang: str = "en") -> Path:
    """The converted GGUF in the cache (<cache root>/models), converting it on first use."""
    import glassllm

    folder = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "models"
    path = folder / f"glassllm-{lang}-{glassllm.__version__}-F16.gguf"
    if not path.is_file():
        convert_glassllm(path, "gguf", lang=lang, weight_type="F16")
    return path


def distill(teacher: str | Path, out: str | Path, layers: int = 2, steps: int = 300, seed: int = 0) -> Path:
    """A `layers`-block draft of glassllm: the teacher's Hugging Face folder (F32), its embedding,
    first blocks and final norm as the start, trained to give the teacher's next-token
    distribution on text the teacher writes. Same vocabulary and tokenizer: a draft model (-md)
    for glassllm, as the small models that draft for a large one are trained."""
    import shutil

    import torch
    import transformers

    torch.manual_seed(seed)
    teacher_model = transformers.AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    config = transformers.AutoConfig.from_pretrained(teacher)
    config.num_hidden_layers = layers
    student = transformers.AutoModelForCausalLM.from_config(config).float()
    student.load_state_dict(teacher_model.state_dict(), strict=False)  # blocks past `layers` are left out
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(Path(teacher) / "tokenizer.json"))
    starts = ["Alice", "The Queen", "“I", "The Hatter", "So she", "The Mock Turtle", "Down", "The King", "What"]
    with torch.no_grad():
        texts = [
            teacher_model.generate(
                torch.tensor([tokenizer.encode(s)]), max_new_tokens=96, do_sample=True, temperature=0.8
            )[0]
            for _ in range(6)
            for s in starts
        ]
    optimizer = torch.optim.AdamW(student.parameters(), lr=1e-3)
    for _ in range(steps):
        for i in torch.randint(len(texts), (8,)).tolist():
            x = texts[i][None]
            with torch.no_grad():
                target = torch.log_softmax(teacher_model(x).logits, -1)
            got = torch.log_softmax(student(x).logits, -1)
            loss = torch.nn.functional.kl_div(got, target, log_target=True, reduction="batchmean") / x.shape[1]
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    out = Path(out)
    student.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(teacher) / name).exists():
            shutil.copy(Path(teacher) / name, out / name)
    return out
