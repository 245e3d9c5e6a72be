"""llama.cpp's own Hugging Face to GGUF converter (convert_hf_to_gguf.py from the llama-cpp-python
sdist kernels/ggml_source.py pins), and a tiny random Gemma 3 for it to convert."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from shardwire.weights.cache import default_cache_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kernels"))
import ggml_source  # noqa: E402

PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # all the converter reads of vendor/llama.cpp


def _archive(into: Path) -> Path:
    """The pinned sdist: the copy benchmarks/build_llama_cpp.sh downloaded where its hash matches, else pip's."""
    name, version, sha = ggml_source.LLAMA_CPP
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "shardwire", "llama.cpp")
    local = Path(os.environ.get("LLAMA_CPP_CACHE") or cache, "src", f"{name.replace('-', '_')}-{version}.tar.gz")
    if local.is_file() and hashlib.sha256(local.read_bytes()).hexdigest() == sha:
        return local
    # pip reads an sdist's metadata with its build backend before it keeps it: here in an isolated
    # environment (ggml_source._sdist, run inside shardwire's build, takes the build's own)
    into.mkdir(parents=True, exist_ok=True)
    (into / "pinned.txt").write_text(f"{name}=={version} --hash=sha256:{sha}\n")
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet", "-d", str(into),
         "-r", str(into / "pinned.txt")],
        capture_output=True,
        text=True,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"pip could not download {name}=={version}: " + " ".join(done.stderr.splitlines()[-3:]))
    return into / local.name


def converter() -> Path:
    """convert_hf_to_gguf.py with its conversion/ and gguf-py/, extracted once into the cache."""
    root = default_cache_dir() / "converter" / ggml_source.LLAMA_CPP[1]
    script = root / PARTS[0]
    if script.is_file():
        return script
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    try:
        archive = _archive(tmp / "sdist")
        for part in PARTS:
            top = ggml_source._extract(archive, tmp, f"vendor/llama.cpp/{part}")
        os.rename(top / "vendor" / "llama.cpp", root)
    except OSError as e:
        if not script.is_file():  # else another process extracted it first
            raise RuntimeError(f"could not extract llama.cpp's converter into {root}: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return script


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
    import torch
    import transformers

    from shardwire_kit.synthetic import load_vocab

    vocab = load_vocab("gpt-2")
    meta = vocab.gguf_metadata
    fields = dict(
        vocab_size=vocab.size,  # the converter keeps as many embedding rows as the tokenizer has tokens
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
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**(fields | config))).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):  # zeros at init: Gemma scales by (1 + w)
                p.copy_(torch.randn(p.shape) * 0.1)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    (folder / "tokenizer.json").write_text(vocab.tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(vocab.tokenizer_config, indent=2))
    return folder
