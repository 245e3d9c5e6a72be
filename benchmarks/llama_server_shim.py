#!/usr/bin/env python3
"""A stand-in for the `llama-server` binary: takes llama-server's command line, maps what has a
shardwire meaning onto `shardwire serve` (one process, no workers) and execs it.

    LLAMA_SERVER_BIN_PATH=benchmarks/llama_server_shim.py pytest unit/test_basic.py  # in llama.cpp's tests

Any model the command line names (--hf-repo, --hf-file, --model-url, a -m that does not exist)
becomes a small local GGUF this script writes once: Llama 2's SentencePiece vocabulary (the
family of the suite's stories260K; a small built-in BPE where ../shared/vocab is absent), random
weights, 4096 tokens of context, no chat template (llama-server and shardwire both fall back to
chatml). Flags with no shardwire meaning are dropped, each with a note on stderr.

Run it with the Python that has shardwire installed, or set SHARDWIRE_PYTHON to that Python.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Callable

MODEL_NAME = "llama-server-suite-llama-spm-v1.gguf"

# llama-server flag -> shardwire serve flag, both taking one value.
SAME_MEANING = {
    "--port": "--port",
    "--reasoning": "--reasoning",
    "-rea": "--reasoning",
    "--chat-template-kwargs": "--chat-template-kwargs",
    "--reasoning-format": "--reasoning-format",
    "-n": "-n",
    "--n-predict": "-n",
    "--predict": "-n",
    "--temp": "--temp",
    "--temperature": "--temp",
    "-s": "--seed",
    "--seed": "--seed",
    "--top-k": "--top-k",
    "--top-p": "--top-p",
    "--min-p": "--min-p",
    "--repeat-penalty": "--repeat-penalty",
    "--repeat-last-n": "--repeat-last-n",
    "--api-key": "--api-key",
    "--chat-template": "--chat-template",
    "--chat-template-file": "--chat-template-file",
    "-t": "--threads",
    "--threads": "--threads",
    "--cors-methods": "--cors-methods",
    "--cors-headers": "--cors-headers",
}
SAME_SWITCH = {
    "--metrics": "--metrics",
    "--jinja": "--jinja",
    "--slots": "--slots",
    "--no-slots": "--no-slots",
    "--ui": "--webui",
    "--webui": "--webui",
    "--no-ui": "--no-webui",
    "--no-webui": "--no-webui",
    "--verbose": "--verbose",
    "-v": "--verbose",
    "--cors-credentials": "--cors-credentials",
    "--no-cors-credentials": "--no-cors-credentials",
}
# Read by the shim itself (they shape the flags above), with a value.
OWN = set("--host -c --ctx-size -np --parallel -a --alias -m --model --cors-origins".split())
# Models to download: the stand-in is served instead.
MODEL_FLAGS = set("-hf -hfr --hf-repo -hff --hf-file -mu --model-url".split())
# Dropped, with a value (anything else unknown is taken to have one unless the next word is a flag).
DROPPED_WITH_VALUE = MODEL_FLAGS | set(
    """-md --model-draft -b --batch-size -ub --ubatch-size
    -ngl --n-gpu-layers --gpu-layers --pooling --tags -ctk --cache-type-k -ctv --cache-type-v -fa --flash-attn
    --slot-save-path --grp-attn-n --grp-attn-w --lora --spec-type --spec-draft-n-max --spec-draft-n-min
    --spec-synth-len --spec-synth-rates --mmproj-url --media-path
    --sleep-idle-seconds --cache-ram --tools --tools-runtime --mcp-servers-config --mcp-servers-json
    --models-dir --models-max --models-preset""".split()
)
# Without a value: dropped (--kv-unified only shapes -c and --kv-budget).
SWITCHES = set(
    """--offline --cont-batching -cb --no-cont-batching --embedding --embeddings --reranking --rerank
    --kv-unified --swa-full --no-models-autoload --no-jinja --context-shift
    --no-context-shift --no-mmproj --no-cache-idle-slots --ui-mcp-proxy --backend_sampling""".split()
)


def note(message: str) -> None:
    print(f"llama_server_shim: {message}", file=sys.stderr, flush=True)


def _is_flag(word: str) -> bool:
    return word.startswith("-") and not word.lstrip("-").replace(".", "", 1).isdigit()


def read_command_line(argv: list[str]) -> tuple[dict, list[str], list[str]]:
    """llama-server's argv -> (values of the flags the shim reads itself, shardwire flags, notes)."""
    own: dict[str, str | bool] = {}
    mapped: list[str] = []
    notes: list[str] = []
    i = 0
    while i < len(argv):
        flag, value = argv[i], None
        if "=" in flag and flag.startswith("--"):
            flag, value = flag.split("=", 1)
        takes_value = flag in SAME_MEANING or flag in OWN or flag in DROPPED_WITH_VALUE
        if flag not in SWITCHES and flag not in SAME_SWITCH and not takes_value and value is None:
            takes_value = i + 1 < len(argv) and not _is_flag(argv[i + 1])
        if takes_value and value is None:
            if i + 1 >= len(argv):
                raise SystemExit(f"llama_server_shim: {flag} needs a value")
            value = argv[i + 1]
            i += 1
        i += 1
        if flag in SAME_MEANING:
            mapped += [SAME_MEANING[flag], value]
        elif flag in SAME_SWITCH:
            mapped.append(SAME_SWITCH[flag])
        elif flag in OWN:
            own[flag.lstrip("-")] = value
        elif flag == "--kv-unified":
            own["kv-unified"] = True
        elif flag in MODEL_FLAGS:
            own.setdefault("download", f"{flag} {value}")
        else:
            notes.append(f"{flag} {value}" if value is not None else flag)
    return own, mapped, notes


def serve_command(argv: list[str], stand_in: Callable[[], Path]) -> list[str]:
    """`shardwire serve ...` for llama-server's argv, with notes on stderr for what has no meaning.
    A -m that names a local file is served; any other model, the `stand_in()`."""
    own, mapped, dropped = read_command_line(argv)
    model = own.get("m") or own.get("model")
    if model and Path(model).is_file():
        model_path = Path(model)
    else:
        model_path = stand_in()
        asked = f"-m {model}" if model else own.get("download", "no model")
        note(f"{asked}: nothing is downloaded here; serving the stand-in {model_path}")
    cmd = ["serve", str(model_path), *mapped]
    hosts = [h.strip() for h in str(own.get("host", "127.0.0.1")).split(",") if h.strip()]
    if len(hosts) > 1:
        note(f"shardwire serve listens on one address: {hosts[0]} (not {', '.join(hosts[1:])})")
    cmd += ["--host", hosts[0]]
    parallel = int(own.get("np") or own.get("parallel") or 4)  # llama-server's -np -1 (auto) is 4
    parallel = 4 if parallel < 1 else parallel
    cmd += ["-np", str(parallel)]
    ctx = int(own.get("c") or own.get("ctx-size") or 0)
    if ctx > 0:
        # llama-server's -c is shared by its slots (with --kv-unified each may use all of it, the
        # pool holding -c positions in all); shardwire's is per sequence, --kv-budget the pool's
        cmd += (
            ["-c", str(ctx), "--kv-budget", str(ctx)] if own.get("kv-unified") else ["-c", str(max(1, ctx // parallel))]
        )
    aliases = [a.strip() for a in str(own.get("a") or own.get("alias") or "").split(",") if a.strip()]
    if aliases:
        cmd += ["-a", sorted(aliases)[0]]  # llama-server's id: the first alias in sorted order
        if len(aliases) > 1:
            dropped.append(f"--alias {','.join(sorted(aliases)[1:])} (one name per model)")
    origins = own.get("cors-origins")
    if origins is not None:
        cmd += ["--cors-origins", str(origins)]
    for flag in dropped:
        note(f"dropped {flag}: shardwire serve has no counterpart")
    return cmd


def stand_in_model() -> Path:
    """The stand-in, written once into shardwire's cache: small enough to load in a second on any CPU."""
    home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    path = Path(os.environ.get("SHARDWIRE_CACHE") or Path(home, "shardwire"), "models", MODEL_NAME)
    if path.is_file():
        return path
    from shardwire_kit.synthetic import load_vocab, random_model
    from shardwire_kit.writer import write_gguf

    vocab = load_vocab("llama-spm")
    cfg, tensors = random_model("llama", n_layers=2, dim=64, vocab_size=vocab.size, context_length=4096, tied=True)
    write_gguf(path, cfg, tensors, vocab.gguf_metadata, weight_type="F16", name="llama-server-suite")
    note(f"wrote {path} ({vocab.name} vocabulary)")
    return path


def _python_with_shardwire() -> None:
    """Re-run under SHARDWIRE_PYTHON when this interpreter lacks shardwire or what it needs (a #!
    python3 start; PYTHONPATH may name a checkout that a Python without its packages then finds)."""
    try:
        import shardwire.cli.main  # noqa: F401
    except ImportError:
        python = os.environ.get("SHARDWIRE_PYTHON")
        if not python or os.environ.get("LLAMA_SERVER_SHIM_REEXEC"):
            raise SystemExit("llama_server_shim: shardwire is not importable; set SHARDWIRE_PYTHON") from None
        os.environ["LLAMA_SERVER_SHIM_REEXEC"] = "1"  # a venv's python may resolve to this very binary
        os.execv(python, [python, __file__, *sys.argv[1:]])


def main() -> None:
    _python_with_shardwire()
    cmd = serve_command(sys.argv[1:], stand_in_model)
    note("exec shardwire " + " ".join(cmd))
    os.execv(sys.executable, [sys.executable, "-m", "shardwire", *cmd])


if __name__ == "__main__":
    main()
