"""A long prompt through the DeepSeek-V3 layouts' latent attention in each form: absorbed (each
row over the cached latents, as llama.cpp computes it), expanded (each head's keys and values
decompressed from them once a chunk), and the form the stage's start measured faster for each
chunk's rows (backends/ggml/latent.py, choose_form). One process holds every block.

    python -m benchmarks.latent_forms [--workloads deepseek-q4_k,deepseek-iq2_xxs] [-p 4096] [--chunk 512]
        [--turns 32,64,128,256]

Prints the CPU, the kernels, the choice the start made, and per form the prompt's tokens/s and the
seconds of its first and last chunk (the last sees the whole prompt), the best of --rounds rounds
taken in turn (A B C A B C ...). Then, for each of --turns, the seconds of a chunk of that many rows
read after the whole prompt (a chat's next turn over a long context) in each form.
"""

from __future__ import annotations

import argparse
import logging
import time

import torch

from shardwire.backends.ggml.latent import ALWAYS, LatentGraphs
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu
from shardwire.weights.measure import cpu_model, fastest_formats

from . import models


def prompt_seconds(stage, ids: torch.Tensor, chunk: int) -> list[float]:
    """Seconds of each chunk of the prompt `ids` [1, n] read from position 0 in slot 0."""
    times = []
    for a in range(0, ids.shape[1], chunk):
        start = time.perf_counter()
        stage(ids[:, a : a + chunk], [0], [a])
        times.append(time.perf_counter() - start)
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="deepseek-q4_k,deepseek-iq2_xxs")
    p.add_argument("-p", "--n-prompt", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=512, help="rows of a prompt chunk (the engine's prefill chunk)")
    p.add_argument("--turns", default="32,64,128,256", help="rows of chunks read after the prompt ('' for none)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("-t", "--threads", type=int, default=None, help="threads (default: PyTorch's)")
    args = p.parse_args()
    if not ggml_cpu.available():
        print("ggml's kernels are not built here: the graphs, and both forms, need them")
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(format="  %(message)s")  # the times each start chose by
    logging.getLogger("shardwire.ggml").setLevel(logging.INFO)
    print(f"cpu: {cpu_model()}, {torch.get_num_threads()} thread(s), ggml: {ggml_cpu.build()}")
    print(f"a {args.n_prompt}-token prompt in chunks of {args.chunk}, one process, the best of {args.rounds} rounds")
    rows, turn_rows = [], []
    turns = [int(n) for n in args.turns.split(",") if n]
    for name in args.workloads.split(","):
        model = open_model(models.ensure(models.WORKLOADS[name], models.llama_cpp_prefix()))
        stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest=fastest_formats("cpu", "float32"))
        chosen = "; ".join(stage.choices) or "no latent graphs"
        kernels = " ".join(sorted({f"{m.stored}:{m.fmt}" for m in stage.modules() if hasattr(m, "stored")}))
        print(f"\n{name}: {kernels}\n  the start chose: {chosen}")
        runners = [b.runner for b in stage.blocks if isinstance(b.runner, LatentGraphs)]
        measured = runners[0].crossover if runners else None
        forms = {"absorbed": None, "expanded": ALWAYS, "chosen": measured}
        for graphs in runners:
            graphs.expands()
        stage.allocate_cache(1, args.n_prompt + max(turns, default=0))
        ids = torch.randint(0, model.config.vocab_size, (1, args.n_prompt), generator=torch.Generator().manual_seed(0))
        best: dict[str, list[float]] = {}
        after: dict[tuple[int, str], float] = {}
        for _ in range(args.rounds):
            for form, crossover in forms.items():
                for graphs in runners:
                    graphs.crossover = crossover
                times = prompt_seconds(stage, ids, args.chunk)
                if form not in best or sum(times) < sum(best[form]):
                    best[form] = times
                for n in turns:
                    start = time.perf_counter()
                    stage(ids[:, :n], [0], [args.n_prompt])
                    seconds = time.perf_counter() - start
                    after[n, form] = min(seconds, after.get((n, form), seconds))
        for n in turns:
            ran = "expanded" if measured is not None and measured.expands(n, args.n_prompt + n) else "absorbed"
            turn_rows.append((name, n, *(after[n, form] for form in forms), ran))
        for form, times in best.items():
            rate = args.n_prompt / sum(times)
            ratio = sum(best["absorbed"]) / sum(times)
            rows.append((name, form, rate, ratio, times[0], times[-1]))
    print("\n| file | form | prompt tokens/s | x absorbed | first chunk s | last chunk s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, form, rate, ratio, first, last in rows:
        print(f"| {name} | {form} | {rate:.1f} | {ratio:.2f}x | {first:.2f} | {last:.2f} |")
    if turn_rows:
        print(f"\nA chunk read after the {args.n_prompt}-token prompt, seconds (the best of {args.rounds}):")
        print("\n| file | rows | absorbed | expanded | chosen | the choice ran |")
        print("| --- | ---: | ---: | ---: | ---: | --- |")
        for name, n, absorbed, expanded, chosen, ran in turn_rows:
            print(f"| {name} | {n} | {absorbed:.3f} | {expanded:.3f} | {chosen:.3f} | {ran} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
