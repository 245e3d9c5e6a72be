"""llama.cpp's own Hugging Face to GGUF converter (convert_hf_to_gguf.py from the llama-cpp-python
sdist kernels/ggml_source.py pins) with the chat templates of the models llama.cpp tests
(models/templates), and tiny random models from transformers' config classes for it to convert."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from shardwire.weights.cache import default_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import ggml_source  # noqa: E402

# all the converter reads of vendor/llama.cpp, and the real models' chat templates
PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "models/templates")


def _archive(into: Path) -> Path:
    """The pinned sdist: the copy shardwire's build or benchmarks/build_llama_cpp.sh kept where its
    hash matches, else pip's (then kept)."""
    kept = ggml_source.kept_sdist()
    if kept is not None:
        return kept
    archive = ggml_source._sdist(*ggml_source.LLAMA_CPP, into, isolated=True)
    ggml_source.keep_sdist(archive)
    return archive


def converter() -> Path:
    """convert_hf_to_gguf.py with its conversion/ and gguf-py/, extracted once into the cache."""
    root = default_cache_dir() / "converter" / f"{ggml_source.LLAMA_CPP[1]}-{len(PARTS)}"
    script = root / PARTS[0]
    if script.is_file():
        return script
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        archive = _archive(tmp / "sdist")
        top = ggml_source._extract(archive, tmp, *(f"vendor/llama.cpp/{part}" for part in PARTS))
        os.rename(top / "vendor" / "llama.cpp", root)
    except OSError as e:
        if not script.is_file():  # else another process extracted it first
            raise RuntimeError(f"could not extract llama.cpp's converter into {root}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return script


def chat_template(name: str) -> str:
    """A real model's chat template as llama.cpp's tests keep it (models/templates/NAME.jinja)."""
    return (converter().parent / "models" / "templates" / f"{name}.jinja").read_text()


def convert(hf_folder: Path, out: Path, outtype: str = "f32") -> Path:
    """`out`: the GGUF llama.cpp's converter writes for the Hugging Face model in hf_folder."""
    script = converter()
    env = {k: v for k, v in os.environ.items() if k != "NO_LOCAL_GGUF"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent / "gguf-py"), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, str(script), str(hf_folder), "--outfile", str(out), "--outtype", outtype],
        capture_output=True,
        text=True,
        env=env,
    )
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-20:])
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_folder} (exit {done.returncode}):\n{tail}")
    return out


def tiny_gemma3(folder: Path, *, layers: int = 6, seed: int = 0, **config) -> Path:
    """A random Gemma 3 text model (Gemma3ForCausalLM, float32) on GPT-2's vocabulary, saved as
    transformers saves one. `config` overrides Gemma3TextConfig's fields; rope_scaling={"rope_type":
    "linear", "factor": 8.0} scales the full-attention layers' rope, as Gemma 3 4B-27B ship."""
    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=4,
        max_position_embeddings=256,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        },
        tie_word_embeddings=True,
        layer_types=["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)],
    )
    # its norms are zeros at init: Gemma scales by (1 + w)
    return tiny_hf_model(folder, "Gemma3TextConfig", "Gemma3ForCausalLM", fields | config, seed, ("norm.weight",))


# The special tokens llama.cpp's converter looks up in a GLM-4.5 tokenizer, and those its chat uses
GLM_TOKENS = (
    "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>", "</think>",
    "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
)  # fmt: skip


# What the tiny GLM-4.5 and DeepSeek-V3 share: 8 experts (2 a token) beside a shared one after a
# dense first block, their weights scaled 2.5x, and weights large enough that attention is not near
# uniform (transformers' 0.02 leaves it so)
_TINY_EXPERTS = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    initializer_range=0.15,
)


def tiny_glm4moe(folder: Path, *, layers: int = 4, seed: int = 0, **config) -> Path:
    """A random GLM-4.5 (Glm4MoeForCausalLM, float32) on GPT-2's vocabulary with GLM's special
    tokens: attention biases and q/k norms, RoPE on half of each head, a dense first block, then 8
    experts (2 a token, chosen by sigmoid scores plus a random bias, the weights scaled 2.5x) beside
    a shared one."""
    fields = dict(
        _TINY_EXPERTS,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        use_qk_norm=True,
        attention_bias=True,
        max_position_embeddings=256,
        partial_rotary_factor=0.5,
        num_nextn_predict_layers=0,
    )
    return tiny_hf_model(
        folder,
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        fields | config,
        seed,
        ("e_score_correction_bias",),
        GLM_TOKENS,
        chat_template("GLM-4.6"),  # 4.5's writes calls and thinking alike
    )


# DeepSeek-R1's added tokens: its turns' special, its thinking's and calls' not (its tokenizer reads
# and writes those as text, as llama.cpp then does)
DEEPSEEK_TOKENS = ("<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>")
DEEPSEEK_TEXT_TOKENS = (
    "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
    "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
)  # fmt: skip


def tiny_deepseek3(folder: Path, *, layers: int = 4, seed: int = 0, **config) -> Path:
    """A random DeepSeek-V3 (DeepseekV3ForCausalLM, float32) on GPT-2's vocabulary: latent attention
    (a 32-value latent, 16 rotated and 16 plain dimensions of each query/key head, queries through a
    24-wide bottleneck), YaRN 4x over 64 positions with DeepSeek's temperature, a dense first block,
    then 8 experts in 4 groups (2 groups and 2 experts a token, sigmoid scores plus a random bias,
    the weights scaled 2.5x) beside a shared one, sigmoid scoring as the published config says."""
    fields = dict(
        _TINY_EXPERTS,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=24,
        kv_lora_rank=32,
        qk_rope_head_dim=16,
        qk_nope_head_dim=16,
        v_head_dim=24,
        n_group=4,
        topk_group=2,
        max_position_embeddings=8192,  # room for a long context
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        num_mtp_layers=0,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
    )
    return tiny_hf_model(
        folder,
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        fields | config,
        seed,
        ("e_score_correction_bias",),
        DEEPSEEK_TOKENS,
        chat_template("llama-cpp-deepseek-r1"),  # R1's, calls and all, as llama.cpp's tests keep it
        DEEPSEEK_TEXT_TOKENS,
    )


# The special tokens of OpenAI's harmony format, which gpt-oss's tokenizer and chat template use
HARMONY_TOKENS = (
    "<|startoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>", "<|message|>",
    "<|call|>",
)  # fmt: skip


def tiny_gpt_oss(folder: Path, *, layers: int = 4, seed: int = 0, **config) -> Path:
    """A random gpt-oss (GptOssForCausalLM, float32) on GPT-2's vocabulary with harmony's special
    tokens: attention with biases and a learned sink logit per head, blocks alternating between a
    4-position sliding window and full attention, YaRN 4x over 64 positions (untruncated, as the
    published config says), 8 experts (2 a token, chosen on the router's logits) with biases and the
    clamped SwiGLU. Its RoPE base puts the ends of YaRN's ramp within 0.1% of whole pairs (0 and 2),
    where llama.cpp's rounding of them (it always rounds; gpt-oss's config says not to) changes
    nothing: at the published base the file llama.cpp reads and the folder transformers reads part
    by that rounding, each as its own engine computes it."""
    fields = dict(
        hidden_size=64,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=4,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10800.0,
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
        },
        initializer_range=0.15,
    )
    return tiny_hf_model(
        folder,
        "GptOssConfig",
        "GptOssForCausalLM",
        fields | config,
        seed,
        ("sinks", "bias"),
        HARMONY_TOKENS,
        chat_template("openai-gpt-oss-120b"),
    )


_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)  # e2m1's magnitudes, by code


def _mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[..., K] float32 as OpenAI stores MXFP4: per 32 values an E8M0 scale (the largest value's
    power of two over 4, the largest code's), and 16 bytes holding values 2i and 2i + 1 in their
    low and high nibbles (sign bit 3, then the nearest magnitude's code): blocks [..., K / 32, 16]
    and scales [..., K / 32]."""
    groups = w.reshape(*w.shape[:-1], -1, 32)
    largest = np.abs(groups).max(-1)
    exponent = np.where(largest > 0, np.floor(np.log2(np.maximum(largest, 1e-30))) - 2, -127).clip(-127, 127)
    x = groups / np.exp2(exponent)[..., None]
    code = np.abs(np.abs(x)[..., None] - _FP4).argmin(-1).astype(np.uint8) | ((x < 0).astype(np.uint8) << 3)
    return code[..., 0::2] | (code[..., 1::2] << 4), (exponent + 127).astype(np.uint8)


def openai_mxfp4(folder: Path, out: Path) -> Path:
    """A copy of a transformers-saved gpt-oss folder with its experts as OpenAI publishes them:
    gate_up_proj and down_proj as MXFP4 _blocks and _scales ([experts, out, in / 32, ...], not
    transposed), the config saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, out)
    tensors = load_file(str(out / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = _mxfp4(tensors.pop(name).transpose(1, 2).contiguous().numpy())
        tensors[name + "_blocks"], tensors[name + "_scales"] = torch.from_numpy(blocks), torch.from_numpy(scales)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def teach(folder: Path, prompt: list[int], reply: list[int], margin: float = 4.0, most_steps: int = 400) -> Path:
    """The model saved in `folder` trained in place until, after `prompt`, it writes `reply` greedily
    with each token's logit at least `margin` above the next (so another engine's rounding keeps
    the reply): a tiny model that answers one chat request as a real one would."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    seq, wanted = torch.tensor([prompt + reply]), torch.tensor(reply)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(most_steps):
        # the logits of the positions that predict the reply alone (the head is most of the work)
        logits = model(seq, logits_to_keep=len(reply) + 1).logits[0, :-1]
        top2 = logits.detach().topk(2).values
        if (logits.argmax(-1) == wanted).all() and (top2[:, 0] - top2[:, 1]).min() >= margin:
            model.save_pretrained(folder, safe_serialization=True)
            return folder
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(logits, wanted).backward()
        optimizer.step()
    raise RuntimeError(f"the model in {folder} did not learn the reply in {most_steps} steps")


def tiny_hf_model(
    folder: Path,
    config_class: str,
    model_class: str,
    config: dict,
    seed: int = 0,
    randomized: tuple[str, ...] = (),
    special_tokens: tuple[str, ...] = (),
    template: str | None = None,
    plain_tokens: tuple[str, ...] = (),
) -> Path:
    """A random transformers model of `model_class` (float32) from its own config class, on GPT-2's
    vocabulary plus `special_tokens` (and `plain_tokens`, added but not special), saved as
    transformers saves one (its own config.json keys), with the tokenizer (and `template` as its
    chat template). Parameters and buffers whose names end in one of `randomized` (those
    transformers initializes to constants) get random values."""
    import torch
    import transformers

    from shardwire_kit.synthetic import load_vocab

    vocab = load_vocab("gpt-2")
    meta = vocab.gguf_metadata
    tokenizer = json.loads(vocab.tokenizer_json)
    for token, special in [*((t, True) for t in special_tokens), *((t, False) for t in plain_tokens)]:
        tokenizer["added_tokens"].append(
            dict(id=vocab.size + len(tokenizer["added_tokens"]) - 1, content=token, single_word=False, lstrip=False,
                 rstrip=False, normalized=False, special=special)
        )  # fmt: skip
    tokens = dict(
        # the converter keeps a row per token the tokenizer has
        vocab_size=vocab.size + len(special_tokens) + len(plain_tokens),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    torch.manual_seed(seed)
    cfg = getattr(transformers, config_class)(**(tokens | config))
    model = getattr(transformers, model_class)(cfg).float()
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(randomized):
                p.copy_(torch.randn(p.shape) * 0.1)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    tokenizer_config = vocab.tokenizer_config | ({"chat_template": template} if template else {})
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
