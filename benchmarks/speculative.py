"""Speculative decoding over emulated links: decode tokens/s with and without prompt lookup, side
by side in one run, on 2 and 3 workers whose links are delayed 0, 1 and 5 ms one way.

    python -m benchmarks.speculative --out benchmarks/results/NAME

Each worker is a `shardwire worker` process behind its own relay (benchmarks/relay.py), so every
hop of the ring, and the coordinator's links, cross an emulated link. The coordinator (the
engine, as `serve` runs it) is this process. For each model, worker count and delay, each
prompt kind runs with and without speculation, alternating which goes first, `--alternations`
times; a figure is the median of its runs. The engine is one for all of a model's runs, as a
server's is: what it has measured of its steps' costs carries from one request to the next.

Prompt kinds:
- grounded: a passage, then its first sentence again; the model is asked to go on. Where the
  model continues the passage from its context, lookup's proposals are what it writes.
- open: a question with nothing in the prompt to copy.

Models: glassllm (a 4-block Llama trained on Alice in Wonderland); glassllm taught the passage the
grounded prompt quotes (glassllm_taught_path); the 1B layout in Q4_0 from benchmarks/models.py
(random weights: its continuations are not text); the small Qwen3.5-MoE layout (moe35-q8_0, random
weights), a hybrid whose delta-net state each stage takes back to before a step's refused
proposals.

Random weights write nothing a drafter could foresee, so the hybrid also runs the grounded prompt
with proposals set to be kept at a known rate (shardwire_kit.drafting.Scripted: plain decoding's
own tokens, 7 a step): "scripted-all" keeps every one, "scripted-some" one wrong per proposal a
place further on each step (0 to 7 kept in turn, half on average). Those rows measure what
checking proposals, and taking refused ones back, cost a hybrid; not a drafter. (Where a step of
several rows rounds a near-tie the other way, the output parts from plain decoding's and so do
the scripted proposals: the "tokens" column says so.)

Per cell it also prints the decode steps' costs by width as the engine measured them (what the
length of proposals is chosen from) and the tokens each step gave.

Steps sent ahead (engine/core.py: a speculating sequence's next step sent while the one before it
is in flight, on what that one is expected to give) are on by default, as `serve` runs; the
"-one" variants ("lookup-one", "draft-one") run the same proposals one step in flight at a time,
so that each cell shows what going ahead gains or costs there, and the steps sent ahead and of
them those void. A hybrid sends none (its stages' recurrent state goes back one step at most).

Beside it, unless --no-llama-cpp: llama.cpp on the same files (GGUF; the Hugging Face folders
written as GGUF by shardwire's writer) over the same relays, ggml-rpc-server workers and
llama-server --rpc as the coordinator, plain, with --spec-type ngram-simple and with the draft
model (benchmarks/speculative_llama_cpp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.engine.draft_model import DraftModel
from shardwire.engine.drafting import Acceptance, Speculation
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY
from shardwire.tokenizer import load_tokenizer
from shardwire_kit.drafting import Scripted

from . import speculative_llama_cpp
from .models import CACHE, WORKLOADS, ensure, llama_cpp_prefix
from .relay import Relay, Shaping
from .run import LISTENING, Server, machine_info

PASSAGE = (
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
    "nothing to do: once or twice she had peeped into the book her sister was reading."
)  # with its first words again and 64 tokens after them, it fits glassllm's 128 positions
PROMPTS = {
    "grounded": PASSAGE + "\n\n" + PASSAGE[:20],
    "open": "What did the Queen say to the Hatter",
}


# the prompts a model runs, where not all: the taught glassllm writes its passage over and over
# where nothing in the prompt begins it (its teaching took its other text)
KINDS = {"glassllm-en-taught": ("grounded",)}
SCRIPTED = {"moe35-q8_0"}  # the models also run with Scripted's proposals
SCRIPTED_N = 7  # proposals a scripted step carries: steps 8 wide, one of the widths the engine takes


class ScriptingEngine(Engine):
    """The engine, its sequences' proposals Scripted's while `script` is set: (plain decoding's
    tokens, the prompt's length, whether some are wrong)."""

    script: tuple[list[int], int, bool] | None = None

    def _drafter(self, speculation, slot):
        if self.script is None:
            return super()._drafter(speculation, slot)
        written, n_prompt, refusing = self.script
        self.acceptance.setdefault(speculation.kind, Acceptance())
        return Scripted(written, n_prompt, self.pipeline.vocab_size, SCRIPTED_N, refusing)


def glassllm_path() -> Path:
    from shardwire_kit import glassllm

    path = CACHE / "models" / "glassllm-en.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        glassllm.convert_glassllm(path, "gguf")
    return path


def glassllm_taught_path() -> Path:
    """glassllm (float32, a Hugging Face folder) taught to go on with PASSAGE as the book does
    once a prompt has begun it again: the passage of the book it "knows" that the grounded prompt
    asks it to write back. glassllm alone has not learned the book's words by heart."""
    from shardwire_kit import glassllm
    from shardwire_kit.convert import teach

    folder = CACHE / "models" / "glassllm-en-taught"
    if not (folder / "config.json").exists():
        glassllm.convert_glassllm(folder, "hf", weight_type="F32")
        tokenizer = load_tokenizer(open_model(folder))
        prompt = tokenizer.encode(PROMPTS["grounded"])
        whole = tokenizer.encode(PASSAGE + "\n\n" + PASSAGE)
        teach(folder, prompt, whole[len(prompt) : len(prompt) + 48])
    return folder


def glassllm_draft_path() -> Path:
    """A 2-block draft of glassllm distilled from it (shardwire_kit.glassllm.distill): the
    smaller model of the same vocabulary that proposes for it."""
    from shardwire_kit import glassllm

    folder = CACHE / "models" / "glassllm-en-draft2"
    if not (folder / "config.json").exists():
        teacher = CACHE / "models" / "glassllm-en-hf"
        if not (teacher / "config.json").exists():
            glassllm.convert_glassllm(teacher, "hf", weight_type="F32")
        glassllm.distill(teacher, folder)
    return folder


DRAFTS = {"glassllm-en": glassllm_draft_path}  # the draft model each model (file stem) is run with


def gguf_path(path: Path) -> Path:
    """The model as a GGUF file llama.cpp reads."""
    return path if path.is_file() else speculative_llama_cpp.gguf_of(path)


def model_path(name: str) -> Path:
    if name == "glassllm":
        return glassllm_path()
    if name == "glassllm-taught":
        return glassllm_taught_path()
    return ensure(WORKLOADS[name], llama_cpp_prefix())


def start_workers(n: int, log: Path) -> list[Server]:
    cmd = [sys.executable, "-m", "shardwire", "worker", "--port", "0", "--device", "cpu", "--threads", "1"]
    workers = []
    try:
        for i in range(n):
            env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
            workers.append(Server(f"worker{i}", cmd, f"0-{os.cpu_count() - 1}", env, log))
            workers[-1].address = f"127.0.0.1:{workers[-1].wait_for(LISTENING, 120)[2]}"
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


def one_run(engine: ScriptingEngine, prompt: list[int], n: int, variant: tuple) -> dict:
    """`variant`: (speculation, script as ScriptingEngine takes it, whether steps go ahead)."""
    speculation, engine.script, engine.ahead = variant
    counters = engine.counters
    steps, ahead, void = counters.decode_steps, counters.ahead_steps, counters.void_steps
    handle = engine.submit(Request(prompt, GREEDY, max_tokens=n, ignore_eos=True, speculation=speculation))
    handle.result()
    if handle.error:
        raise RuntimeError(handle.error)
    s = handle.stats
    return {
        "tps": s.decode_tps,
        "tokens": handle.tokens,
        "draft_n": s.draft_n,
        "draft_n_accepted": s.draft_n_accepted,
        "steps": counters.decode_steps - steps,  # the first token comes from the prompt's step
        "ahead": counters.ahead_steps - ahead,
        "void": counters.void_steps - void,
    }


def measure(path: Path, n_workers: int, delays: list[float], args, log: Path) -> list[dict]:
    model = open_model(path)
    tokenizer = load_tokenizer(model)
    n_gen = min(args.n_gen, model.config.context_length - 1)
    kinds = KINDS.get(_name(path), tuple(PROMPTS))
    prompts = {kind: tokenizer.encode(PROMPTS[kind])[: model.config.context_length - n_gen - 1] for kind in kinds}
    ctx = min(model.config.context_length, 512)
    lookup = Speculation(n_max=args.draft_max)
    variants = {"plain": (None, None, True), "lookup": (lookup, None, True), "lookup-one": (lookup, None, False)}
    draft = None
    if _name(path) in DRAFTS and not args.no_draft:
        folder = DRAFTS[_name(path)]()
        draft_file = open_model(folder)
        draft = DraftModel(load_stage(draft_file, 0, draft_file.config.n_layers, weights="fast"), 1, ctx)
        variants["draft"] = (Speculation("draft-simple", n_max=args.draft_max), None, True)
        variants["draft-one"] = (variants["draft"][0], None, False)
    shaping = Shaping(enabled=True)
    if args.llama_cpp is not None:
        draft_file = gguf_path(DRAFTS[_name(path)]()) if "draft" in variants else None
        theirs = speculative_llama_cpp.measure(
            args.llama_cpp, gguf_path(path), draft_file, n_workers, delays, prompts, n_gen, args.alternations,
            args.draft_max, shaping, log,
        )  # fmt: skip
        args.llama_cpp_rows += [{"model": _name(path), **row} for row in theirs]
    workers = start_workers(n_workers, log)
    relays = [Relay(tuple_address(w.address), shaping=shaping) for w in workers]
    rows = []
    try:
        cluster = Cluster([r.address for r in relays], cache_dir=args.cache / "coordinator", show_progress=False)
        try:
            cluster.connect(model)
            pipeline = cluster.load(cluster.make_plan(ctx=ctx, weights="auto"))  # as `serve` plans by default
            if pipeline.recurrent:  # it sends no step ahead: the "-one" variants would run the same
                variants = {name: v for name, v in variants.items() if not name.endswith("-one")}
            engine = ScriptingEngine(pipeline, tokenizer, draft=draft)
            try:
                for delay in delays:
                    shaping.delay_s = delay / 1000
                    for kind, prompt in prompts.items():
                        # warm the links and the graphs at this delay; what plain decoding writes
                        written = one_run(engine, prompt, n_gen, variants["plain"])["tokens"]
                        scripted = _name(path) in SCRIPTED and kind == "grounded"
                        for name, refusing in (("scripted-all", False), ("scripted-some", True)):
                            variants.pop(name, None)
                            if scripted:
                                variants[name] = (Speculation(n_max=SCRIPTED_N), (written, len(prompt), refusing), True)
                        runs = {name: [] for name in variants}
                        for alt in range(args.alternations):
                            order = list(variants) if alt % 2 == 0 else list(reversed(variants))
                            for name in order:
                                runs[name].append(one_run(engine, prompt, n_gen, variants[name]))
                        rows.append(_row(path, n_workers, delay, kind, runs))
                        rows[-1]["step_ms"] = {w: round(c * 1000, 2) for w, c in engine.step_costs.by_width().items()}
                        print(_line(rows[-1]), flush=True)
            finally:
                engine.close()
        finally:
            cluster.close()
    finally:
        speculative_llama_cpp.stop(relays, workers)
    return rows


def _row(path: Path, n_workers: int, delay: float, kind: str, runs: dict) -> dict:
    plain = statistics.median(r["tps"] for r in runs["plain"])
    row = {
        "model": _name(path),
        "workers": n_workers,
        "delay_ms": delay,
        "prompt": kind,
        "plain_tps": round(plain, 2),
        "same_tokens": all(r["tokens"] == runs["plain"][0]["tokens"] for rs in runs.values() for r in rs),
        "runs": {k: [round(r["tps"], 2) for r in v] for k, v in runs.items()},
    }
    for name in runs:
        if name != "plain":
            tps = statistics.median(r["tps"] for r in runs[name])
            row[name] = {
                "tps": round(tps, 2),
                "ratio": round(tps / plain, 3) if plain else None,
                "draft_n": sum(r["draft_n"] for r in runs[name]),
                "draft_n_accepted": sum(r["draft_n_accepted"] for r in runs[name]),
                "ahead": sum(r["ahead"] for r in runs[name]),
                "void": sum(r["void"] for r in runs[name]),
                "tokens_per_step": round(sum(len(r["tokens"]) - 1 for r in runs[name]) / steps, 2)
                if (steps := sum(r["steps"] for r in runs[name]))
                else None,
            }
    return row


def _name(path: Path) -> str:
    return path.stem if path.is_file() else path.name


def tuple_address(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def _variants(row: dict) -> list[str]:
    return [
        name for name in ("lookup", "lookup-one", "draft", "draft-one", "scripted-all", "scripted-some") if name in row
    ]


def _line(row: dict) -> str:
    parts = [
        f"{row['model']:<18} {row['workers']} workers {row['delay_ms']:>4} ms  {row['prompt']:<8}  "
        f"plain {row['plain_tps']:8.2f} t/s"
    ]
    for name in _variants(row):
        v = row[name]
        parts.append(
            f"{name} {v['tps']:8.2f} t/s {v['ratio']:.2f}x kept {v['draft_n_accepted']}/{v['draft_n']} "
            f"{v['tokens_per_step']} tokens/step" + (f", {v['ahead']} ahead ({v['void']} void)" if "ahead" in v else "")
        )
    parts.append("same tokens" if row["same_tokens"] else "TOKENS DIFFER")
    return "  ".join(parts) + f"\n    step cost by width: {_costs(row)}"


def _costs(row: dict) -> str:
    """Each width's step cost, and as a multiple of a one-token step's."""
    costs = {int(width): ms for width, ms in (row.get("step_ms") or {}).items()}  # str keys read back from JSON
    one = costs.get(1)
    return ", ".join(f"{w}: {ms} ms" + (f" ({ms / one:.2f}x)" if one else "") for w, ms in costs.items())


def report(rows: list[dict], machine: dict) -> str:
    dirty = " and changes not yet committed" if machine.get("shardwire_tree_dirty") else ""
    out = [
        "# Speculative decoding over emulated links",
        "",
        f"CPU: {machine.get('cpu')} ({machine.get('cores')} cores); kernels: {machine.get('kernels', '?')}; "
        f"commit {machine.get('commit')}{dirty}. Decode tokens/s, the median of each variant's runs; "
        "lookup: prompt lookup (--spec-type ngram-simple); draft: the draft model (-md).",
        "",
        *_table(
            rows,
            {
                "tokens/step": lambda r, v: v["tokens_per_step"],
                "steps ahead (void)": lambda r, v: f"{v['ahead']} ({v['void']})" if "ahead" in v else "",
                "tokens": lambda r, v: "same" if r["same_tokens"] else "differ",
                "step cost by width": lambda r, v: _costs(r),
            },
        ),
    ]
    return "\n".join(out) + "\n"


def _table(rows: list[dict], extra: dict | None = None) -> list[str]:
    """A markdown table of each row's variants; `extra`: more columns, each a function of the row
    and the variant's figures."""
    extra = extra or {}
    head = ["model", "workers", "one-way delay", "prompt", "plain t/s", "variant", "t/s", "ratio", "proposals kept"]
    out = ["| " + " | ".join([*head, *extra]) + " |", "|" + "---|" * (len(head) + len(extra))]
    for r in rows:
        for name in _variants(r):
            v = r[name]
            cells = [r["model"], r["workers"], f"{r['delay_ms']} ms", r["prompt"], r["plain_tps"], name, v["tps"]]
            cells += [f"{v['ratio']}x", f"{v['draft_n_accepted']}/{v['draft_n']}", *(f(r, v) for f in extra.values())]
            out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def report_llama_cpp(rows: list[dict]) -> str:
    """llama.cpp's figures on the same files and links, where it ran."""
    if not rows:
        return "llama.cpp: not run (--no-llama-cpp, or no build)\n"
    out = [
        "## llama.cpp beside it: ggml-rpc-server workers behind the same relays, llama-server --rpc "
        "(--spec-type ngram-simple, size n 3; -md with --spec-type draft-simple, the draft in its process)",
        "",
        *_table(rows),
    ]
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="glassllm-taught,glassllm,1b-q4_0,moe35-q8_0")
    p.add_argument("--workers", default="2,3")
    p.add_argument("--delays", default="0,1,5", help="one-way delays in ms (default: %(default)s)")
    p.add_argument("--n-gen", type=int, default=64)
    p.add_argument("--alternations", type=int, default=2)
    p.add_argument("--draft-max", type=int, default=16)
    p.add_argument("--no-draft", action="store_true", help="leave out the draft model's runs")
    p.add_argument(
        "--no-llama-cpp", action="store_true", help="leave out llama.cpp's runs (llama-server --rpc, the same files)"
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the coordinator, as `serve -t 1`: tiny models run fastest on one thread
    args.out.mkdir(parents=True, exist_ok=True)
    args.cache = Path(tempfile.mkdtemp(prefix="shardwire-speculative-"))  # the coordinator's weight cache
    machine = machine_info()
    machine["kernels"] = _kernel_line()
    args.llama_cpp = None if args.no_llama_cpp else llama_cpp_prefix()
    args.llama_cpp_rows = []
    delays = [float(d) for d in args.delays.split(",")]
    rows = []
    for name in args.models.split(","):
        path = model_path(name)
        for n in (int(w) for w in args.workers.split(",")):
            rows += measure(path, n, delays, args, args.out / "workers.log")
    theirs = args.llama_cpp_rows
    (args.out / "speculative.json").write_text(
        json.dumps({"machine": machine, "rows": rows, "llama_cpp": theirs}, indent=1)
    )
    text = report(rows, machine) + "\n" + report_llama_cpp(theirs) + "\n" + summary(rows) + "\n"
    (args.out / "speculative.md").write_text(text)
    print(text, end="")
    return 0


def summary(rows: list[dict], delay: float = 5.0, workers: int = 3) -> str:
    """The headline figures at `delay` ms and `workers`: prompt lookup on grounded prompts (the
    models that go on with a passage of their prompt: glassllm taught it), its worst cell on
    open-ended prompts, the draft model's on open-ended prompts; before them, the hybrid's with
    scripted proposals, and what steps sent ahead gave over the same proposals one step in flight
    at a time. A figure not measured in this run is "n/a"."""
    cells = [r for r in rows if r["delay_ms"] == delay and r["workers"] == workers]

    def worst(figure, needs: str, prompt: str, models=None) -> str:
        """The least `figure` of the cells of `prompt` (and `models`) that ran the variant `needs`."""
        found = [
            figure(r)
            for r in cells
            if r["prompt"] == prompt and needs in r and (models is None or r["model"] in models)
        ]
        return f"{min(found):.2f}x" if found else "n/a"

    def ratio(variant: str, prompt: str, models=None) -> str:
        return worst(lambda r: r[variant]["ratio"], variant, prompt, models)

    def ahead(variant: str, prompt: str, models=None) -> str:
        """The variant's tokens/s over its one-step-in-flight run's."""
        return worst(lambda r: r[variant]["tps"] / r[f"{variant}-one"]["tps"], f"{variant}-one", prompt, models)

    hybrid = (
        f"hybrid ({', '.join(sorted(SCRIPTED))}, scripted proposals): all kept {ratio('scripted-all', 'grounded')}, "
        f"some kept {ratio('scripted-some', 'grounded')} ({delay:g} ms links, {workers} workers)"
    )
    gains = (
        f"steps sent ahead, over one step in flight: grounded {ahead('lookup', 'grounded', {'glassllm-en-taught'})}, "
        f"open-ended {ahead('lookup', 'open')}, draft model {ahead('draft', 'open')} "
        f"({delay:g} ms links, {workers} workers)"
    )
    return (
        f"{hybrid}\n{gains}\nspeculative decoding: grounded {ratio('lookup', 'grounded', {'glassllm-en-taught'})}, "
        f"open-ended {ratio('lookup', 'open')}, draft model {ratio('draft', 'open')} "
        f"({delay:g} ms links, {workers} workers)"
    )


def _kernel_line() -> str:
    """The worker's start line naming the CPU's kernel choices (what measured fastest here)."""
    out = subprocess.run(
        [sys.executable, "-c", "from shardwire.weights.in_use import compute_line; print(compute_line('cpu'))"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    return out.stdout.strip() or out.stderr.strip()[-200:]


if __name__ == "__main__":
    sys.exit(main())
