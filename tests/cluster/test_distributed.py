"""One model split across real worker processes on loopback gives the single-process tokens."""

import re

import pytest

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.sampling import SamplingParams

from commands import run
from models import PROMPT, converted_checkpoint, hf_path, model_path
from runs import (
    GREEDY_LOGPROBS,
    assert_same,
    distributed,
    generate,
    single_process,
)

pytestmark = pytest.mark.slow  # worker processes


def test_two_workers_gguf(worker_pool, tmp_path):
    path = model_path("llama", "F32")
    workers = worker_pool(2)
    got, plan, _ = distributed(path, [w.address for w in workers], tmp_path / "coord")
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4)]
    assert_same(single_process(path), got)


def test_a_prompt_on_two_workers_goes_in_pieces_that_overlap_and_gives_the_single_process_tokens(worker_pool, tmp_path):
    """With the default 512-token chunks, a 100-token prompt goes to 2 workers in 4 pieces (about 2
    a stage, none under MIN_PIECE rows: 32, 32, 32, 4), each stage taking the next while the other
    runs one; one process takes it whole, and gives the same tokens in 32-token chunks as they do
    (a chunk reads the keys of those before it from the cache, as float16)."""
    path = model_path("llama", "F32")
    prompt = [(7 * i + 3) % 256 for i in range(100)]
    steps = []
    whole = single_process(path, prompt=prompt, prefill_chunk=512, steps=steps, n=8)
    reference = single_process(path, prompt=prompt, prefill_chunk=32, steps=steps, n=8)
    assert steps == [1, 4] and whole[0] == reference[0]
    workers = worker_pool(2)
    got, _, _ = distributed(
        path, [w.address for w in workers], tmp_path / "coord", prompt=prompt, prefill_chunk=512, steps=steps, n=8
    )
    assert steps == [1, 4, 4]
    assert_same(reference, got)


def test_three_workers_uneven_split_safetensors(worker_pool, tmp_path):
    path = hf_path("qwen3")
    workers = worker_pool(3)
    got, plan, _ = distributed(path, [w.address for w in workers], tmp_path / "coord", tensor_split=[2, 1, 1])
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 3), (3, 4)]
    assert_same(single_process(path), got)


def test_stage_on_the_coordinator_and_a_worker_with_two_devices(worker_pool, tmp_path):
    """-ngl 3 keeps block 0 on the coordinator's CPU; one worker holds two devices; the
    coordinator's own device takes the last stage."""
    path = model_path("qwen2", "F32")
    two = worker_pool(1, devices="cpu:0,cpu:1")[0]
    got, plan, _ = distributed(
        path, [two.address], tmp_path / "coord", n_gpu_layers=3, local_devices=["cpu"], tensor_split=[1, 1, 1]
    )
    labels = [(s.device.worker, s.device.name, s.start, s.end) for s in plan.stages]
    assert labels == [
        ("local:cpu", "cpu", 0, 1),
        (two.address, "cpu:0", 1, 2),
        (two.address, "cpu:1", 2, 3),
        ("local", "cpu", 3, 4),
    ]
    assert_same(single_process(path), got)


def test_sampled_generation_matches_with_the_same_seed(worker_pool, tmp_path):
    path = model_path("mistral", "Q8_0")
    workers = worker_pool(2)
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=1234, repeat_penalty=1.1)
    got, _, _ = distributed(path, [w.address for w in workers], tmp_path / "coord", sampling=sampling)
    assert got[0] == single_process(path, sampling=sampling)[0]


def test_second_start_ships_no_weights_and_a_corrupt_cache_file_is_fetched_again(worker_pool, tmp_path):
    path = model_path("llama", "Q4_0")
    workers = worker_pool(2)
    addresses = [w.address for w in workers]
    reference = single_process(path, n=8)
    first, _, stats = distributed(path, addresses, tmp_path / "coord", n=8)
    assert stats["streamed"] == sum(t.nbytes for t in open_model(path).tensors.values())
    second, _, stats = distributed(path, addresses, tmp_path / "coord", n=8)
    assert stats == {"file": 0, "cache": stats["cache"], "streamed": 0} and stats["cache"] > 0
    assert first[0] == second[0] == reference[0]

    victim = next(p for p in (workers[1].cache_dir / "weights").glob("*/*") if p.stat().st_size > 10000)
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    third, _, stats = distributed(path, addresses, tmp_path / "coord", n=8)
    assert stats["streamed"] == victim.stat().st_size
    assert third[0] == reference[0]


def test_worker_uses_its_own_copy_of_the_model_file(worker_pool, tmp_path):
    path = model_path("qwen3", "Q8_0")
    worker = worker_pool(1, extra=("--model-dir", str(path.parent)))[0]
    _, _, stats = distributed(path, [worker.address], tmp_path / "coord", n=4)
    assert stats["streamed"] == 0 and stats["cache"] == 0 and stats["file"] > 0


def test_unreachable_worker_is_named(tmp_path):
    path = model_path("llama", "F32")
    cluster = Cluster(["127.0.0.1:1"], cache_dir=tmp_path, show_progress=False)
    with pytest.raises(ConnectionError, match="worker 127.0.0.1:1 is unreachable"):
        cluster.connect(open_model(path))


def test_glassllm_split_across_two_workers_continues_like_glassllm(worker_pool, tmp_path):
    glassllm = pytest.importorskip("glassllm")
    from shardwire.tokenizer import load_tokenizer
    from shardwire_kit.glassllm import convert_glassllm

    path = convert_glassllm(tmp_path / "glass.gguf", "gguf")
    model, tokenizer = glassllm.load_pretrained("en")
    prompt = tokenizer.encode("Alice was beginning to get very tired")
    expected = [step.token for step in model.generate(prompt, 40, greedy=True)]
    assert load_tokenizer(open_model(path)).encode("Alice was beginning to get very tired") == prompt
    workers = worker_pool(2)
    (tokens, _), plan, _ = distributed(path, [w.address for w in workers], tmp_path / "coord", n=40, prompt=prompt)
    assert len(plan.stages) == 2 and tokens == expected


def test_each_worker_reports_the_dtype_its_hardware_computes_best_and_the_plan_uses_it(worker_pool, tmp_path):
    from shardwire.weights.policy import default_dtype

    addresses = [w.address for w in worker_pool(2)]
    cluster = Cluster(addresses, cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(open_model(model_path("llama", "F16")))
        assert [d.dtype for link in cluster.links for d in link.devices] == [default_dtype("cpu")] * 2
        cluster.links[1].devices[0].dtype = "float16"  # as a worker on a machine with other hardware says
        plan = cluster.make_plan(ctx=64)
        assert [s.device.dtype for s in plan.stages] == [default_dtype("cpu"), "float16"]
        # bf16 would round F16 weights: a CPU computes them in float32 instead
        cluster.links[1].devices[0].dtype = "bfloat16"
        assert [s.device.dtype for s in cluster.make_plan(ctx=64).stages] == [default_dtype("cpu"), "float32"]
        assert {s.device.dtype for s in cluster.make_plan(ctx=64, dtype="bfloat16").stages} == {
            "bfloat16"
        }  # --dtype wins
    finally:
        cluster.close()
    cluster = Cluster(addresses, cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(open_model(model_path("llama", "F32")))
        cluster.links[1].devices[0].dtype = "float16"
        # an F32 file computes in float32 whatever a worker's own dtype
        assert {s.device.dtype for s in cluster.make_plan(ctx=64).stages} == {"float32"}
    finally:
        cluster.close()


def test_concurrent_sequences_share_decode_steps(worker_pool, tmp_path):
    """Results come back one step at a time; sequences that become ready while every stage is
    busy wait for the next step instead of each sending its own, so steps carry many rows."""
    path = model_path("llama", "F32")
    model = open_model(path)
    cluster = Cluster([w.address for w in worker_pool(2)], cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(model)
        pipeline = cluster.load(cluster.make_plan(ctx=128, n_slots=4, dtype="float32"))
        widths = []
        submit = pipeline.submit
        pipeline.submit = lambda step: (widths.append(len(step.rows)) if step.width == 1 else None, submit(step))[1]
        engine = Engine(pipeline)
        try:
            handles = [engine.submit(Request(PROMPT[i:], GREEDY_LOGPROBS, max_tokens=24)) for i in range(4)]
            together = [[e.token for e in h if e.token is not None] for h in handles]
        finally:
            engine.close()
        pipeline.submit = submit
        alone = [generate(pipeline, prompt=PROMPT[i:])[0] for i in range(4)]
    finally:
        cluster.close()
    assert together == alone
    decode_rows = sum(widths)
    assert max(widths) >= 2 and len(widths) <= decode_rows / 1.5, widths


MOE_FILES = [("mixtral", "F32"), ("qwen3moe", "hf"), ("qwen3moe", "Q8_0"), ("qwen2moe", "hf")]


@pytest.mark.parametrize("name,form", MOE_FILES)
def test_mixture_of_experts_split_over_two_workers(worker_pool, tmp_path, name, form):
    """Expert tensors ship, cache and load like any other; the plan counts them per block."""
    path = hf_path(name) if form == "hf" else model_path(name, form)
    workers = worker_pool(2)
    got, plan, _ = distributed(path, [w.address for w in workers], tmp_path / "coord")
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4)]
    assert_same(single_process(path), got)


def _expert_file(family: str):
    if family == "qwen3moe":
        return model_path("qwen3moe", "Q8_0")
    convert = pytest.importorskip("shardwire_kit.convert")
    make = {"deepseek2": convert.tiny_deepseek3, "glm4moe": convert.tiny_glm4moe, "gpt-oss": convert.tiny_gpt_oss}
    return converted_checkpoint(family, make[family], "gguf")


@pytest.mark.parametrize("family", ["qwen3moe", "deepseek2", "glm4moe", "gpt-oss"])
def test_override_tensor_keeps_experts_on_a_second_device_of_the_worker(worker_pool, tmp_path, family):
    """-ot 'ffn_.*_exps=cpu:1': the worker's cpu:0 takes every block, its cpu:1 the routed experts'
    matrices (ASSIGN carries the pattern; the worker builds them there and counts them against it),
    on Qwen's experts and on the families with more beside them: a dense first block and a shared
    expert, which stay (DeepSeek-V3, GLM-4.5), and gpt-oss's expert biases, which the pattern
    matches too but which are added, not multiplied, and stay with the stage."""
    path = _expert_file(family)
    two = worker_pool(1, devices="cpu:0,cpu:1")[0]
    model = open_model(path)
    cluster = Cluster([two.address], cache_dir=tmp_path / "coord", show_progress=False)
    try:
        cluster.connect(model)
        plan = cluster.make_plan(ctx=256, dtype="float32", overrides=[("ffn_.*_exps", "cpu:1")])
        (stage,) = plan.stages
        assert (stage.device.name, stage.start, stage.end) == ("cpu:0", 0, model.config.n_layers)
        ((elsewhere, held),) = stage.elsewhere.items()
        assert elsewhere.name == "cpu:1"
        if family != "qwen3moe":  # F32 files, held as stored whatever this CPU measured: the matrices alone
            assert held == sum(t.nbytes for n, t in model.tensors.items() if re.search(r"_exps\.\d+\.weight$", n))
        got = generate(cluster.load(plan))
    finally:
        cluster.close()
    assert_same(single_process(path), got)


def test_plan_shows_what_override_tensor_keeps_where(worker_pool, tmp_path):
    path = model_path("qwen3moe", "Q8_0")
    two = worker_pool(1, devices="cpu:0,cpu:1")[0]
    shown = run("plan", str(path), "--rpc", two.address, "-ot", "ffn_.*_exps=cpu:1", "--cache-dir", str(tmp_path / "c"))
    assert shown.returncode == 0, shown.stderr
    assert f"-> {two.address}/cpu:1" in shown.stdout and "/ffn_.*_exps/" in shown.stdout
    missing = run("plan", str(path), "--rpc", two.address, "-ot", "exps=cuda:3", "--cache-dir", str(tmp_path / "c"))
    assert missing.returncode == 1 and "has no device cuda:3 (it has cpu:0, cpu:1)" in missing.stderr
