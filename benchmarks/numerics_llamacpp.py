"""Logits of the same GGUF file from llama.cpp and from shardwire (packed and dequantized weights).

    bash benchmarks/build_llama_cpp.sh && python -m benchmarks.packed_models
    python -m benchmarks.numerics_llamacpp [--files glassllm-Q4_0,...] [--threads 2] [--steps 64]

For each file: llama.cpp greedily continues a prompt for `steps` tokens; both engines then read
that same sequence one token at a time (shardwire's decode path, so its packed kernels run), and
the logits that predict each new token are compared: max and mean absolute difference, top-1
agreement (teacher-forced). Each engine also continues the prompt on its own (free-running
greedy): agreement counts equal tokens position by position, and the first divergence is given.
llama.cpp quantizes activations to 8 bits for its quantized dot products, so equality is not
expected; where logits are nearly flat (random weights) free-running sequences part at the first
near-tie.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

PREFIX = Path(os.environ.get("LLAMA_CPP_PREFIX", Path.home() / ".cache/shardwire/llama.cpp/0.3.36"))
MODELS = Path.home() / ".cache/shardwire/bench-models"
RANDOM_PROMPT = [1, 450, 4996, 17354, 1701, 432, 17204, 975, 278, 17366, 11203, 29889, 13, 1576, 338, 263]


def llama_cpp():
    """The llama_cpp bindings of the llama.cpp build in PREFIX, or None when it is not built. Import
    them only in a child process (LlamaCpp): they load their own libggml, and in a process that has
    also loaded ggml-python's (shardwire's CPU kernels) llama.cpp crashes in decode."""
    if not _built():
        return None
    os.environ.setdefault("LLAMA_CPP_LIB_PATH", str(PREFIX / "lib"))
    if str(PREFIX / "python") not in sys.path:
        sys.path.insert(0, str(PREFIX / "python"))
    import llama_cpp as module

    return module


def _built() -> bool:
    return (PREFIX / "lib" / "libllama.so").exists() and (PREFIX / "python" / "llama_cpp").is_dir()


@functools.cache
def unavailable() -> str | None:
    """Why llama.cpp cannot be run here (not built, or its bindings do not import), or None."""
    if not _built():
        return f"llama.cpp is not built in {PREFIX} (benchmarks/build_llama_cpp.sh)"
    probe = "from benchmarks import numerics_llamacpp; numerics_llamacpp.llama_cpp()"
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=root)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit code {done.returncode}"]
        return f"llama.cpp's Python bindings do not import: {last[0]}"
    return None


class LlamaCpp:
    """llama.cpp's engine for one file, held by a child process (see llama_cpp)."""

    def __init__(self, path: Path, n_ctx: int, threads: int):
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._child = context.Process(target=_serve, args=(theirs, str(path), n_ctx, threads), daemon=True)
        self._child.start()
        theirs.close()
        self._answer()  # loaded, or why not

    def _call(self, name: str, *args):
        self._conn.send((name, args))
        return self._answer()

    def _answer(self):
        try:
            ok, value = self._conn.recv()
        except EOFError:
            self._child.join(5)
            raise RuntimeError(f"llama.cpp's process ended (exit code {self._child.exitcode})") from None
        if not ok:
            raise RuntimeError(f"llama.cpp: {value}")
        return value

    def greedy(self, ids: list[int], n: int) -> list[int]:
        return self._call("greedy", ids, n)

    def logits(self, seq: list[int], n_prompt: int) -> np.ndarray:
        """Logits predicting seq[n_prompt:], fed one token at a time after the prompt."""
        return self._call("logits", seq, n_prompt)

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        """Logits at every position of ids, read as one prompt."""
        return self._call("prompt_logits", ids)

    def close(self) -> None:
        if self._child.is_alive():
            self._conn.send(("close", ()))
            self._child.join(10)
        self._conn.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Engine:
    def __init__(self, path: str, n_ctx: int, threads: int):
        self.llm = llama_cpp().Llama(
            model_path=path,
            n_ctx=n_ctx,
            logits_all=True,
            n_threads=threads,
            n_threads_batch=threads,
            n_gpu_layers=0,
            verbose=False,
        )

    def greedy(self, ids: list[int], n: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(ids)
        out = []
        for _ in range(n):
            out.append(int(np.argmax(self.llm.scores[self.llm.n_tokens - 1])))
            self.llm.eval([out[-1]])
        return out

    def logits(self, seq: list[int], n_prompt: int) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(seq[:n_prompt])
        for t in seq[n_prompt:-1]:
            self.llm.eval([t])
        return np.array(self.llm.scores[n_prompt - 1 : len(seq) - 1])

    def prompt_logits(self, ids: list[int]) -> np.ndarray:
        self.llm.reset()
        self.llm.eval(ids)
        return np.array(self.llm.scores[: len(ids)])


def _serve(conn, path: str, n_ctx: int, threads: int) -> None:
    try:
        engine = _Engine(path, n_ctx, threads)
    except Exception as e:
        conn.send((False, f"{type(e).__name__}: {e}"))
        return
    conn.send((True, None))
    while True:
        try:
            name, args = conn.recv()
        except EOFError:  # the parent has gone
            return
        if name == "close":
            return
        try:
            conn.send((True, getattr(engine, name)(*args)))
        except Exception as e:
            conn.send((False, f"{type(e).__name__}: {e}"))


class Shardwire:
    def __init__(self, path: Path, n_ctx: int, weights: str, dtype: str = "float32", fastest: dict | None = None):
        import torch

        from shardwire.devices import parse_dtype
        from shardwire.formats import open_model
        from shardwire.pipeline.loading import load_stage

        model = open_model(path)
        self.stage = load_stage(
            model, 0, model.config.n_layers, weights=weights, dtype=parse_dtype(dtype), fastest=fastest
        )
        self.n_ctx, self.torch = n_ctx, torch

    def _step(self, ids: list[int], start: int):
        return self.stage(self.torch.tensor([ids]), [0], [start])[0, -1].float()

    def greedy(self, ids: list[int], n: int) -> list[int]:
        self.stage.allocate_cache(1, self.n_ctx)
        logits, out = self._step(ids, 0), []
        for i in range(n):
            out.append(int(logits.argmax()))
            logits = self._step(out[-1:], len(ids) + i)
        return out

    def logits(self, seq: list[int], n_prompt: int) -> np.ndarray:
        self.stage.allocate_cache(1, self.n_ctx)
        rows = [self._step(seq[:n_prompt], 0)]
        for i, t in enumerate(seq[n_prompt:-1]):
            rows.append(self._step([t], n_prompt + i))
        return self.torch.stack(rows).numpy()


def agreement(a: list[int], b: list[int]) -> tuple[int, int | None]:
    same = sum(x == y for x, y in zip(a, b))
    return same, next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def compare(path: Path, prompt: list[int], steps: int = 64, threads: int = 2) -> dict:
    """Figures for one file: per engine pair, logit differences and top-1 / greedy agreement."""
    import torch

    torch.set_num_threads(threads)
    n_ctx = len(prompt) + steps + 8
    engines = {
        "llama.cpp": LlamaCpp(path, n_ctx, threads),
        "packed": Shardwire(path, n_ctx, "packed"),
        "dequant": Shardwire(path, n_ctx, "dequant"),
    }
    with engines["llama.cpp"]:
        greedy = {k: e.greedy(prompt, steps) for k, e in engines.items()}
        seq = prompt + greedy["llama.cpp"]
        logits = {k: e.logits(seq, len(prompt)) for k, e in engines.items()}
    out = {"file": path.name, "steps": steps}
    for a, b in [("packed", "llama.cpp"), ("dequant", "llama.cpp"), ("packed", "dequant")]:
        diff = np.abs(logits[a] - logits[b])
        same, first = agreement(greedy[a], greedy[b])
        out[f"{a} vs {b}"] = {
            "max_abs": float(diff.max()),
            "mean_abs": float(diff.mean()),
            "top1_teacher_forced": int((logits[a].argmax(-1) == logits[b].argmax(-1)).sum()),
            "greedy_same": same,
            "greedy_first_diff": first,
        }
    ref = logits["llama.cpp"]
    top2 = np.sort(ref, -1)[:, -2:]
    out["margins"] = (top2[:, 1] - top2[:, 0]).tolist()  # llama.cpp's top-2 gap at each step
    out["logit_spread"] = float((ref.max(-1) - ref.min(-1)).mean())
    out["smallest_top2_margin"] = min(out["margins"])
    return out


GLASSLLM_PROMPTS = [
    "Alice was beginning to get very tired of sitting by her sister on the bank",
    "“Curiouser and curiouser!” cried Alice (she was so much surprised).\n\nThe",
    "“Who are you?” said the Caterpillar.",
    "The Queen",
]


def prompts_for(name: str) -> list[list[int]]:
    if name.startswith("glassllm"):
        from shardwire_kit import glassllm

        _, tok = glassllm.load("en")
        return [tok.encode(text) for text in GLASSLLM_PROMPTS]
    return [RANDOM_PROMPT]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--files", default="glassllm-Q4_0,glassllm-Q8_0,glassllm-Q4_K_M,rand-1b-Q4_0,rand-1b-Q8_0,rand-1b-Q4_K_M"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=64)
    args = p.parse_args()
    if reason := unavailable():
        sys.exit(reason)
    for name in args.files.split(","):
        for i, prompt in enumerate(prompts_for(name)):
            report(compare(MODELS / f"{name}.gguf", prompt, args.steps, args.threads), f"prompt {i}")


def report(r: dict, label: str = "") -> None:
    print(
        f"{r['file']} {label}: logit spread {r['logit_spread']:.1f}, smallest top-2 margin "
        f"{r['smallest_top2_margin']:.4f}"
    )
    for pair, v in r.items():
        if isinstance(v, dict):
            first = v["greedy_first_diff"]
            where = "" if first is None else f", llama.cpp's top-2 margin there {r['margins'][first]:.4f}"
            print(
                f"  {pair:22} max |d| {v['max_abs']:.4f}  mean |d| {v['mean_abs']:.5f}  top-1 (teacher-forced) "
                f"{v['top1_teacher_forced']}/{r['steps']}  greedy {v['greedy_same']}/{r['steps']} "
                f"(first difference at {first}{where})",
                flush=True,
            )


if __name__ == "__main__":
    main()
