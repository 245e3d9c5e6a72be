"""The paged KV cache as a user sees it: a chat's time to first token per turn with prefix reuse
on and off, and the workers' memory with many sequence slots.

    python -m benchmarks.prefix_cache [--model PATH] [--turns 10] [--other /tmp/before]

Chat: two workers (one thread each, pinned) and `shardwire serve --rpc w1,w2 -np 1` as a user
runs them. A scripted conversation of --turns user messages; each turn sends the whole
conversation so far to /v1/chat/completions, streamed, greedy, --reply tokens, with logprobs so
that every token arrives in a chunk of its own. Two conversations run side by side on the same
server, one request each in turn (the order alternating), one with `cache_prompt: false`: the
time to first token is measured by the client, from sending the request to the first chunk that
carries a token. Each turn's reply must be the same tokens with and without the cache.

Memory: `shardwire serve -np 16 -c 8192` over two workers; each worker's /proc/PID/status once
the model is loaded and idle, while two short sequences decode, and after; beside the bytes of
16 whole contexts of its blocks' keys and values. With --other (a git worktree of another
commit, e.g. main before the paged cache), the same for that tree's workers and server.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from . import models, run
from .memory import settled, status

HERE = Path(__file__).resolve().parent


USER_TURNS = [
    "I am planning a trip along the river next spring and would like to know which small towns "
    "are worth a stop, where the old bridges are, and how long the walk between them takes.",
    "That helps. Could you also tell me which of those towns has a market on weekends, and what "
    "the local bakeries are known for, since I would like to bring something back home?",
    "We will travel with two children who like trains and boats. Is there a way to take a ferry "
    "for part of the route, and do the ferries run early in the morning or only at noon?",
    "My sister wants to join us for the second week. She prefers quiet places with a library or "
    "a museum nearby, so which town would you suggest she stays in while we move on?",
    "What should we pack for the weather in April? I have heard that the valley is warm during "
    "the day but cold at night, and that rain comes quickly from the hills in the west.",
    "Are there any festivals in late April or early May? We would enjoy music in the square, but "
    "we would rather avoid the days when every inn is full and the prices are doubled.",
    "One more question about money: do the small shops take cards, or should we carry cash, and "
    "is there a bank in each town or only in the larger ones near the railway station?",
    "We also want to rent bicycles for a few days. Is the path along the water flat enough for a "
    "child of eight, and are there places to stop for lunch every ten kilometres or so?",
    "Thank you. Could you put the whole plan together, day by day, with the towns, the ferries, "
    "the market days and the places to sleep, so that I can print it on a single page?",
    "Finally, if the weather turns bad for two days, which indoor places along the way would keep "
    "two children and three adults happy, and which of them open on a Monday morning?",
]


class Cluster:
    """Two workers and a server from one tree's code, each pinned to its own core."""

    def __init__(self, tree: Path, model: Path, log: Path, serve_args: list[str]):
        self.workers = run.start_tree_workers(tree, 2, log)
        try:
            self.port = run.free_port()
            cmd = [sys.executable, "-m", "shardwire", "serve", str(model), "--port", str(self.port), "-t", "1"]
            cmd += ["--rpc", ",".join(w.address for w in self.workers), *serve_args]
            coordinator, _ = run.cores_for(2, 1)
            self.server = run.Server("serve", cmd, coordinator, run.tree_env(tree), log, cwd=tree)
            run.wait_healthy(self.port, self.server.proc, 300)
        except BaseException:
            self.stop()
            raise

    def chat(self, messages: list[dict], max_tokens: int, cache: bool) -> dict:
        """One streamed chat request: time to the first token, the reply's tokens and text, and
        how many prompt tokens the server found cached."""
        body = {
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 2,
            "stream_options": {"include_usage": True},
            "cache_prompt": cache,
        }
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        sent = time.perf_counter()
        first, entries, usage = None, [], None
        with urllib.request.urlopen(request, timeout=900) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                data = json.loads(line[6:])
                usage = data.get("usage") or usage
                for choice in data["choices"]:
                    new = (choice.get("logprobs") or {}).get("content") or []
                    if new and first is None:
                        first = time.perf_counter() - sent
                    entries += new
        return {
            "ttft_s": first,
            "tokens": [e["token"] for e in entries],
            "logprobs": [e["logprob"] for e in entries],
            # how far the chosen token was ahead of the next best: a near-tie flips on rounding
            "margins": [e["top_logprobs"][0]["logprob"] - e["top_logprobs"][1]["logprob"] for e in entries],
            "text": "".join(e["token"] for e in entries),
            "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
        }

    def stop(self) -> None:
        for p in [getattr(self, "server", None), *self.workers]:
            if p is not None:
                p.stop()


def chat_turns(tree: Path, model: Path, args, log: Path) -> list[dict]:
    """Each turn twice on the same conversation (the one with the cache's replies): with the
    cache and without it, the order alternating."""
    cluster = Cluster(tree, model, log, ["-np", "1", "-c", "4096", "--chat-template", "chatml"])
    rows, messages = [], []
    try:
        for turn, text in enumerate(USER_TURNS[: args.turns]):
            messages.append({"role": "user", "content": text})
            row = {"turn": turn + 1}
            for cache in (True, False) if turn % 2 == 0 else (False, True):
                row["on" if cache else "off"] = cluster.chat(messages, args.reply, cache)
            on, off = row["on"], row["off"]
            messages.append({"role": "assistant", "content": on["text"]})
            row.update(compare(on, off))
            rows.append(row)
            where = "" if row["same"] else f" from token {row['first_difference']} (margin {row['margin']:.4f})"
            print(
                f"turn {turn + 1:>2}: prompt {on['prompt_tokens']:>4} tokens, {on['cached_tokens']:>4} cached; "
                f"TTFT {on['ttft_s']:.2f} s on, {off['ttft_s']:.2f} s off; same reply: {row['same']}{where}; "
                f"max |logprob on - off| before it {row['logprob_diff']:.2e}",
                flush=True,
            )
    finally:
        cluster.stop()
    return rows


def compare(on: dict, off: dict) -> dict:
    """Where two replies to one prompt part, how close the cache's choice was to a tie there,
    and how far their log-probabilities were apart before it."""
    pairs = list(zip(on["tokens"], off["tokens"]))
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    common = len(pairs) if first is None else first
    diff = max((abs(a - b) for a, b in zip(on["logprobs"][:common], off["logprobs"][:common])), default=0.0)
    margin = None if first is None else min(on["margins"][first], off["margins"][first])
    return {"same": first is None, "first_difference": first, "margin": margin, "logprob_diff": diff}


LIVE_AFTER_S = 8.0  # after two requests go out: both prefilled and decoding


def memory(tree: Path, model: Path, log: Path) -> dict:
    """Each worker's status once loaded and idle, while two short requests decode, and after."""
    cluster = Cluster(tree, model, log, ["-np", "16", "-c", "8192", "--chat-template", "chatml"])
    try:
        samples = {"loaded": [settled(w.proc.pid) for w in cluster.workers]}
        requests = [
            threading.Thread(target=cluster.chat, args=([{"role": "user", "content": text}], 48, True))
            for text in USER_TURNS[:2]
        ]
        for t in requests:
            t.start()
        time.sleep(LIVE_AFTER_S)
        samples["live"] = [status(w.proc.pid) for w in cluster.workers]
        for t in requests:
            t.join()
        time.sleep(1.0)
        samples["after"] = [status(w.proc.pid) for w in cluster.workers]
    finally:
        cluster.stop()
    return samples


def whole_contexts_bytes(model: Path) -> list[int]:
    """Keys and values of 16 whole 8192-token contexts of each worker's blocks (an even split)."""
    import torch

    from shardwire.formats import open_model
    from shardwire.kvcache import KVCache, pages_for
    from shardwire.pipeline.plan import split_blocks_evenly

    cfg = open_model(model).config
    return [
        KVCache.nbytes_for(n, cfg.n_kv_heads, 16 * pages_for(8192), cfg.head_dim, torch.float16)
        for n in split_blocks_evenly(cfg.n_layers, [1.0, 1.0])
    ]


def mib(n: int) -> str:
    return f"{n / 2**20:,.0f} MiB"


def print_memory(name: str, samples: dict, whole: list[int]) -> None:
    for i, (loaded, live, after) in enumerate(zip(samples["loaded"], samples["live"], samples["after"])):
        print(
            f"{name} worker {i}: loaded and idle RssAnon {mib(loaded['RssAnon'])}; with 2 live sequences "
            f"+{mib(live['RssAnon'] - loaded['RssAnon'])} anonymous (VmRSS +{mib(live['VmRSS'] - loaded['VmRSS'])}); "
            f"after them +{mib(after['RssAnon'] - loaded['RssAnon'])}; peak VmHWM {mib(after['VmHWM'])}; "
            f"16 whole contexts of its blocks: {mib(whole[i])}"
        )


def main() -> int:
    run.private_state_dir()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="GGUF file (default: the 1B-layout Q4_0 bench model)")
    p.add_argument("--turns", type=int, default=10, help=f"user turns, at most {len(USER_TURNS)}")
    p.add_argument("--reply", type=int, default=16, help="tokens per reply")
    p.add_argument("--other", type=Path, default=None, help="another checkout to measure memory beside this one")
    p.add_argument("--skip-chat", action="store_true")
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    model = args.model or models.ensure(models.WORKLOADS["1b-q4_0"], None)
    this = HERE.parent
    log = Path(tempfile.mkdtemp(prefix="shardwire-prefix-")) / "processes.log"
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    print(f"CPU: {cpu}; model {model.name}; 2 workers, 1 thread each; processes' output: {log}")
    out: dict = {"cpu": cpu, "model": model.name}
    if not args.skip_chat:
        rows = chat_turns(this, model, args, log)
        out["chat"] = rows
        same = sum(r["same"] for r in rows)
        on = [r["on"]["ttft_s"] for r in rows]
        off = [r["off"]["ttft_s"] for r in rows]
        print(
            f"\nTTFT over {len(rows)} turns: cache on {statistics.mean(on):.2f} s mean, last {on[-1]:.2f} s; "
            f"off {statistics.mean(off):.2f} s mean, last {off[-1]:.2f} s; "
            f"replies the same with and without the cache: {same} of {len(rows)}"
        )
    if not args.skip_memory:
        whole = whole_contexts_bytes(model)
        trees = {"this": this} | ({"other": args.other.resolve()} if args.other else {})
        out["memory"] = {}
        print()
        for name, tree in trees.items():
            samples = memory(tree, model, log)
            out["memory"][name] = samples
            print_memory(name, samples, whole)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
