"""The `shardwire` command as a user runs it: generate, plan, and their errors."""

import pytest
import torch

from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY
from shardwire.tokenizer import load_tokenizer

from commands import run
from models import model_path
from workers import WorkerProcess

pytestmark = pytest.mark.slow  # worker processes


def test_generate_prints_the_continuation_and_speeds():
    path = model_path("qwen2", "Q8_0")
    out = run("generate", str(path), "-p", "Once upon a time", "-n", "12", "--temp", "0", "-t", "1")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("Once upon a time") and len(out.stdout) > len("Once upon a time\n")
    assert "prompt:" in out.stderr and "tokens/s" in out.stderr and "generation: 12 tokens" in out.stderr


def test_generate_across_workers_prints_the_same_text(tmp_path):
    path = model_path("llama", "F16")
    local = run("generate", str(path), "-p", "The river", "-n", "10", "--temp", "0", "-t", "1")
    with WorkerProcess(tmp_path / "a") as a, WorkerProcess(tmp_path / "b") as b:
        split = run(
            "generate",
            str(path),
            "-p",
            "The river",
            "-n",
            "10",
            "--temp",
            "0",
            "-t",
            "1",
            "--rpc",
            f"{a.address},{b.address}",
            "-ts",
            "3,1",
            "--cache-dir",
            str(tmp_path / "c"),
        )
    assert split.returncode == 0, split.stderr
    assert split.stdout == local.stdout
    assert "blk" not in split.stdout and "0-2+embd" in split.stderr  # the plan table, on stderr


def test_plan_prints_the_split_and_refuses_an_impossible_one(tmp_path):
    path = model_path("llama", "F32")
    tenth = sum(t.nbytes for t in open_model(path).tensors.values()) // 10
    with WorkerProcess(tmp_path / "a") as a, WorkerProcess(tmp_path / "b", extra=("--mem", str(tenth))) as b:
        ok = run("plan", str(path), "--rpc", a.address, "--cache-dir", str(tmp_path / "c"))
        assert ok.returncode == 0, ok.stderr
        assert a.address in ok.stdout and "0-3+embd+head" in ok.stdout and "yes" in ok.stdout
        wide = ("-np", "16", "-c", "256", "--rpc", a.address, "--cache-dir", str(tmp_path / "c"))
        every, budget = run("plan", str(path), *wide), run("plan", str(path), *wide, "--kv-budget", "500")
        assert "KV pages for 4096 positions" in every.stdout and "KV pages for 512 positions" in budget.stdout
        bad = run(
            "plan", str(path), "--rpc", f"{a.address},{b.address}", "-ts", "1,3", "--cache-dir", str(tmp_path / "c")
        )
    assert bad.returncode == 1
    assert "does not fit" in bad.stderr and b.address in bad.stderr and "short by" in bad.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs_close_to_float32(dtype):
    model = open_model(model_path("qwen3", "F16"))
    ids = torch.tensor([[5, 17, 300, 42, 7, 100, 3, 99]])
    ref = load_stage(model, 0, 4)
    half = load_stage(model, 0, 4, dtype=dtype)
    for s in (ref, half):
        s.allocate_cache(1, 32)
    a, b = ref(ids, [0], [0], all_logits=True), half(ids, [0], [0], all_logits=True)
    assert b.dtype == torch.float32 and half.cache.k.dtype == dtype
    spread = float(a.max() - a.min())
    assert float((a - b).abs().mean()) < 0.02 * spread


def test_stop_strings_and_end_of_sequence():
    path = model_path("qwen2", "F32")
    model = open_model(path)
    tok = load_tokenizer(model)
    engine = Engine(LocalPipeline([load_stage(model, 0, 4)], n_slots=2, ctx=128), tok)
    try:
        prompt = tok.encode("Once upon a time")
        free = engine.submit(Request(prompt, GREEDY, max_tokens=24, ignore_eos=True))
        text = free.result()
        assert free.finish_reason == "length" and len(free.tokens) == 24
        stop = text[len(text) // 3 : len(text) // 3 + 3]
        cut = engine.submit(Request(prompt, GREEDY, max_tokens=24, stop=(stop,), ignore_eos=True))
        assert cut.result() == text[: text.index(stop)] and cut.finish_reason == "stop"
        # end of sequence: make the first generated token a stop token
        first = free.tokens[0]
        tok.stop_ids = frozenset({first})
        eos = engine.submit(Request(prompt, GREEDY, max_tokens=24))
        assert eos.result() == "" and eos.finish_reason == "stop" and eos.tokens == [first]
    finally:
        engine.close()
