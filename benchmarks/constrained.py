"""What constrained decoding costs per decoded token, free and constrained side by side.

    python -m benchmarks.constrained [--tokens 200] [--workers 2]

1. On the sampling stage alone: sample() from random logits over real vocabularies (Qwen 152k,
   Llama 3 128k, Llama 2 32k), free, then with a JSON schema's matcher (mask, sample, consume).
2. End to end: the synthetic Qwen2 test model split over worker processes on loopback, one
   sequence decoding free (ignore_eos) and one under a JSON schema, in decode ms per token.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from shardwire.constrain import Grammar, Matchers, RowConstraint, vocabulary_of
from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import SamplingParams, sample
from shardwire.tokenizer import load_tokenizer
from tests.support.models import PROMPT, model_path
from tests.support.workers import WorkerProcess

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9999},
            "name": {"type": "string", "maxLength": 16},
            "kind": {"enum": ["a", "b", "c"]},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
    "minItems": 200,
}
WARM = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=5)


def sampler_cost(name: str, steps: int, repeats: int = 5) -> tuple[float, float]:
    """Best of `repeats` runs of `steps` tokens each, in ms per token (the machine may be shared)."""
    torch.set_num_threads(1)  # as a worker started with --threads 1
    tokenizer = load_tokenizer(open_model(model_path(name)))
    vocab = vocabulary_of(tokenizer)
    grammar = Grammar.compile("json_schema", SCHEMA, vocab)
    n = tokenizer.vocab_size
    logits = torch.randn(steps, n) * 3
    vocab.lltokenizer()  # built once per process, not per token
    free, constrained = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(steps):
            sample(logits[i], WARM, i)
        free.append((time.perf_counter() - start) / steps)
        matchers = Matchers()
        matchers.use_vocabulary(vocab)
        matchers.prepare(0, RowConstraint(grammar.key, 0, grammar.text, []))
        start = time.perf_counter()
        for i in range(steps):
            matchers.prepare(0, RowConstraint(grammar.key, i))
            token = sample(logits[i], WARM, i, allowed=matchers.allowed(0, n)).token
            matchers.consume(0, token)
        constrained.append((time.perf_counter() - start) / steps)
        matchers.close()
    return min(free) * 1e3, min(constrained) * 1e3


def end_to_end(n_workers: int, tokens: int) -> tuple[float, float]:
    path = model_path("qwen2", "F32")
    model = open_model(path)
    tokenizer = load_tokenizer(model)
    grammar = Grammar.compile("json_schema", SCHEMA, vocabulary_of(tokenizer))
    with tempfile.TemporaryDirectory() as tmp:
        workers = [WorkerProcess(Path(tmp) / f"w{i}").start() for i in range(n_workers)]
        cluster = Cluster([w.address for w in workers], cache_dir=Path(tmp) / "coord", show_progress=False)
        try:
            cluster.connect(model)
            pipeline = cluster.load(cluster.make_plan(ctx=tokens + 64, n_slots=1, dtype="float32"))
            engine = Engine(pipeline, tokenizer)
            results = []
            for g in (None, grammar) * 4:  # alternating; the first pair warms up
                handle = engine.submit(Request(PROMPT, WARM, max_tokens=tokens, ignore_eos=True, grammar=g))
                handle.result()
                assert handle.error is None, handle.error
                results.append(1e3 / handle.stats.decode_tps)
            engine.close()
        finally:
            cluster.close()
            for w in workers:
                w.stop()
    return min(results[2::2]), min(results[3::2])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    print("sampling stage alone, ms per token (free -> with a JSON schema's matcher):")
    for name in ("qwen2", "llama3.1", "llama"):
        free, constrained = sampler_cost(name, args.tokens)
        print(f"  {name:9s} {free:6.3f} -> {constrained:6.3f}  (+{constrained - free:.3f})")
    free, constrained = end_to_end(args.workers, args.tokens)
    print(f"decode through {args.workers} workers, ms per token (best of 3): free {free:.2f}, schema {constrained:.2f}")


if __name__ == "__main__":
    main()
