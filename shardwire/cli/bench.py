"""`shardwire bench`: prompt and decode speed of one model, in this process or across --rpc
workers, measured the way llama.cpp's llama-bench measures it, so the two read side by side.

    shardwire bench model.gguf                              # single process
    shardwire bench model.gguf --rpc host1:50052,host2:50052 -p 512 -n 128 -r 3

Tests, each repeated -r times after one warm-up:
  ppP   a P-token prompt of random tokens, one token sampled: P / seconds is prompt tokens/s,
        and the seconds are the time to first token of a P-token prompt
  tgN   N tokens decoded one after another from an empty context (a 1-token prompt, N - 1
        more steps: N forward passes, as llama-bench's tgN)
  tgNxS with --streams S: S sequences decoding N tokens each at once; aggregate tokens/s
Sampling is greedy on the last stage; the random prompts are the same for every run with the
same --seed. Progress lines on stderr ("... prompt run 1/3") have llama-bench's wording, so a
harness can follow either tool the same way.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def add_bench_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("benchmark (llama-bench's flags)")
    g.add_argument(
        "-p", "--n-prompt", type=int, default=512, help="prompt tokens; 0 skips the test (default: %(default)s)"
    )
    g.add_argument(
        "-n", "--n-gen", type=int, default=128, help="decoded tokens; 0 skips the test (default: %(default)s)"
    )
    g.add_argument("-r", "--repetitions", type=int, default=3, help="runs of each test (default: %(default)s)")
    g.add_argument(
        "--streams", type=int, default=0, help="also decode -n tokens in this many concurrent sequences (default: off)"
    )
    g.add_argument("--no-warmup", action="store_true", help="skip the warm-up run of each test")
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompt tokens (default: %(default)s)")
    g.add_argument("-o", "--output", choices=["md", "json"], default="md", help="(default: %(default)s)")
    g.add_argument("--progress", action="store_true", help="print progress lines on stderr")


def peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _stats(samples_ns: list[int], tokens: int) -> dict:
    ts = [tokens / (s / 1e9) for s in samples_ns]
    mean = sum(ts) / len(ts)
    sd = (sum((t - mean) ** 2 for t in ts) / (len(ts) - 1)) ** 0.5 if len(ts) > 1 else 0.0
    return {"samples_ns": samples_ns, "avg_ns": sum(samples_ns) // len(samples_ns), "avg_ts": mean, "stddev_ts": sd}


def run_bench(args: argparse.Namespace) -> int:
    from ..coordinator.launch import build_pipeline
    from ..devices import set_threads
    from ..engine import Engine, Request
    from ..formats import open_model
    from ..sampling import GREEDY
    from ..weights.measure import cpu_model

    if args.repetitions < 1:
        raise ValueError("-r must be at least 1")
    set_threads(args.threads)
    t0 = time.perf_counter()
    model = open_model(args.model)
    vocab = model.config.vocab_size
    if args.ctx_size == 4096:  # the generic default: size the context to the tests instead
        args.ctx_size = max(args.n_prompt, args.n_gen) + 8
    streams = max(args.streams, 0)
    pipeline, cluster = build_pipeline(model, args, n_slots=max(1, streams), quiet=True)
    formats, compute = weight_formats(pipeline, cluster), compute_lines(pipeline, cluster)
    load_s = time.perf_counter() - t0
    engine = Engine(pipeline, None)  # 512-token prefill chunks, as llama-bench's -ub 512 (pieces of them on workers)
    wire_total = cluster.wire_bytes if cluster is not None else (lambda: 0)
    rng = random.Random(args.seed)
    workers = [a for a in (args.rpc or "").split(",") if a.strip()]
    progress = args.progress

    def say(text: str) -> None:
        if progress:
            print(f"shardwire-bench: {text}", file=sys.stderr, flush=True)

    def run(prompts: list[list[int]], max_tokens: int) -> tuple[int, list]:
        start = time.perf_counter_ns()
        handles = [engine.submit(Request(p, GREEDY, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
        for h in handles:
            for _ in h:
                pass
        elapsed = time.perf_counter_ns() - start
        for h in handles:
            if h.error:
                raise RuntimeError(h.error)
        return elapsed, handles

    say("loaded")
    tests = []
    if args.n_prompt > 0:
        tests.append(("pp", args.n_prompt, 0, 1))
    if args.n_gen > 0:
        tests.append(("tg", 0, args.n_gen, 1))
    if args.n_gen > 0 and streams > 1:
        tests.append(("tg", 0, args.n_gen, streams))
    results = []
    try:
        for index, (kind, n_prompt, n_gen, n_seq) in enumerate(tests, 1):
            label = "prompt" if kind == "pp" else "generation"
            name = f"pp{n_prompt}" if kind == "pp" else f"tg{n_gen}" + (f"x{n_seq}" if n_seq > 1 else "")

            def prompts():
                if kind == "pp":
                    return [[rng.randrange(vocab) for _ in range(n_prompt)]]
                return [[rng.randrange(vocab)] for _ in range(n_seq)]

            if not args.no_warmup:
                say(f"benchmark {index}/{len(tests)}: warmup {label} run")
                run(prompts(), 1 if kind == "pp" else min(n_gen, 4))
            samples, wire_bytes = [], []
            for rep in range(args.repetitions):
                say(f"benchmark {index}/{len(tests)}: {label} run {rep + 1}/{args.repetitions}")
                before = wire_total()
                elapsed, _ = run(prompts(), 1 if kind == "pp" else n_gen)
                wire_bytes.append(wire_total() - before)
                samples.append(elapsed)
            tokens = n_prompt if kind == "pp" else n_gen * n_seq
            entry = {"test": name, "n_prompt": n_prompt, "n_gen": n_gen, "streams": n_seq, **_stats(samples, tokens)}
            if kind == "tg":
                entry["coordinator_bytes_per_token"] = sum(wire_bytes) / (tokens * len(wire_bytes))
            results.append(entry)
    finally:
        engine.close()
        pipeline.close()
    say("done")
    report = {
        "system": "shardwire",
        "model": str(args.model),
        "workers": workers,
        "threads": args.threads,
        "load_s": load_s,
        "peak_rss": peak_rss(),
        "cpu": cpu_model(),
        "formats": formats,
        "compute": compute,
        "tests": results,
    }
    if args.output == "json":
        print(json.dumps(report, indent=1))
    else:
        print(markdown(report))
    return 0


def weight_formats(pipeline, cluster) -> list[str]:
    """Per stage, how its weights are held (which kernels run them) and what its start chose by
    measuring, so figures from different machines or choices are never mixed up."""
    if cluster is not None:
        return [
            "; ".join([f"{s.weights} ({s.device.held(s.formats)})", *cluster.stage_choices.get(i, [])])
            for i, s in enumerate(cluster.plan.stages)
        ]
    from ..model import Linear
    from ..weights import ggml_cpu

    products = {
        kind: {t: "shardwire" if t in ggml_cpu.own_products_used(kind) else "ggml" for t in ggml_cpu.own_products(kind)}
        for kind in ggml_cpu.OWN_PRODUCTS
    }
    out = []
    for stage in pipeline.stages:
        held = sorted({_held(m, products) for m in stage.modules() if isinstance(m, Linear) or hasattr(m, "fmt")})
        out.append("; ".join([f"{_name(stage.dtype)} activations ({' '.join(held)})", *stage.choices]))
    return out


def compute_lines(pipeline, cluster) -> list[str]:
    """For each device the stages run on, the kernels that compute there."""
    if cluster is not None:
        return cluster.plan.compute_lines()
    from ..weights.in_use import compute_line

    return [f"kernels on {d}: {compute_line(d)}" for d in dict.fromkeys(str(s.device) for s in pipeline.stages)]


def _name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _held(module, products: dict[str, dict[str, str]]) -> str:
    """How one weight module is held: its stored type and kernel ("Q4_0:repacked"; with whose
    products take one row and its prompt chunks: "F16:ggml/shardwire-gemv/shardwire-gemm"; a block's experts as one:
    "Q4_K/Q4_K/Q6_K experts:ggml"), or the dtype of a dense matrix ("float32:dense")."""
    from ..weights.policy import held_label

    if not hasattr(module, "stored"):
        return f"{_name(module.weight.dtype)}:dense"
    if isinstance(module.stored, str):
        return held_label(module.stored, module.fmt, products["gemm"], products["gemv"])
    return f"{'/'.join(module.stored)} experts:{module.fmt}"


def markdown(report: dict) -> str:
    lines = [
        f"model: {report['model']}  workers: {len(report['workers']) or 'none (single process)'}  "
        f"load: {report['load_s']:.1f} s  coordinator peak RSS: {report['peak_rss'] / 2**20:.0f} MiB",
        f"cpu: {report['cpu']}  weights: {', '.join(report['formats'])}",
        *report["compute"],
        "",
        "| test | tokens/s | ms/token | time to first token | coordinator bytes/token |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for t in report["tests"]:
        per = t["avg_ns"] / 1e6 / max(1, t["n_prompt"] or t["n_gen"])
        ttft = f"{t['avg_ns'] / 1e6:.1f} ms" if t["n_prompt"] else ""
        wire = (
            f"{t['coordinator_bytes_per_token']:.0f}"
            if "coordinator_bytes_per_token" in t and report["workers"]
            else ""
        )
        lines.append(f"| {t['test']} | {t['avg_ts']:.2f} ± {t['stddev_ts']:.2f} | {per:.2f} | {ttft} | {wire} |")
    return "\n".join(lines)
