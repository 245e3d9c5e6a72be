"""Packed on-device weights: every GGUF type decodes bit for bit as gguf does, every packed format
multiplies like its dequantized weights, Q/K rows are un-interleaved in packed form too, and the
plan's memory accounting is what the built stage holds."""

import json

import numpy as np
import pytest
import torch

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.enums import WEIGHT_FORMATS
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.pipeline.plan import PlanDevice, make_plan
from shardwire.sampling import GREEDY
from shardwire.weights import codecs, ggml_cpu, measure, policy
from shardwire.weights import packed as packing
from shardwire.weights.pack import pack_matrix
from shardwire.weights.policy import weight_formats, weight_nbytes

from matrices import matrix
from models import PROMPT, model_path

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
EXACT = {"Q4_0": "int4", "Q4_1": "int4", "Q4_K": "int4", "Q8_0": "int8x2"}  # lossless up to bf16 scales
# rms error a requantized format adds, as a share of the type's own rms error (measured: 0.19, 0.44,
# 0.17-0.21, 0.41); the total error is at most sqrt(1 + 0.5^2) = 1.12x the type's own
REQUANT_BOUND = 0.5


@pytest.mark.parametrize("dtype", TYPES)
def test_unpack_is_gguf_bit_for_bit(dtype):
    _, raw, ref = matrix(dtype)
    assert torch.equal(codecs.unpack(raw, dtype).dequantize(), ref)


def rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


GGML = ["ggml"] if ggml_cpu.available() else []


@pytest.mark.parametrize(
    "dtype,fmt", [(t, f) for t in TYPES for f in ("int4", "int8", "gguf", *GGML)] + [("Q8_0", "int8x2")]
)
def test_packed_matmul_equals_dequantized_matmul(dtype, fmt):
    w, raw, ref = matrix(dtype)
    module = pack_matrix(raw, dtype, fmt, "cpu", torch.float32)
    packed = module.gather(torch.arange(w.shape[0]))
    own = rms(ref - torch.from_numpy(w))
    added = rms(packed - ref) / own
    if fmt in ("gguf", "ggml"):
        assert torch.equal(packed, ref)
    elif EXACT.get(dtype) == fmt:
        # only the bf16 rounding of scale and zero: no more than rounding the weights to bf16 does
        assert added <= 1.2 * rms(ref.bfloat16().float() - ref) / own + 1e-3
    elif policy.FAST[dtype] == fmt:
        assert added <= REQUANT_BOUND
    torch.manual_seed(0)
    bias = torch.randn(w.shape[0])
    module.bias = torch.nn.Parameter(bias, requires_grad=False)
    for x in (torch.randn(1, 1, w.shape[1]), torch.randn(2, 9, w.shape[1])):  # kernel, then dense GEMM
        y = module(x)
        assert y.shape == (*x.shape[:-1], w.shape[0]) and y.dtype == x.dtype
        xr = x.bfloat16().float() if fmt not in ("gguf", "ggml") else x
        expected = xr @ packed.t() + bias
        scale = float(expected.abs().max())
        # bf16 activations and outputs; ggml quantizes the activations to 8 bits, as llama.cpp does
        assert float((y - expected).abs().max()) <= 1e-2 * scale


@pytest.mark.parametrize("fmt", ["int4", "int8x2", "int8", "gguf", *GGML])
def test_rows_and_row_chunks_agree(fmt, monkeypatch):
    """gather (embedding lookups), dequantize(a, b) by chunks, and the dense-GEMM path read the
    same weights, across layout blocks and the padded tail."""
    monkeypatch.setattr(packing, "CHUNK_ELEMENTS", 64 * 64)  # 64-row chunks of a 64-column matrix
    w, raw, ref = matrix("Q8_0", rows=200, cols=64)
    module = pack_matrix(raw, "Q8_0", fmt, "cpu", torch.float32)
    exact = module.gather(torch.arange(200))
    whole = exact.to(module.compute_dtype)
    chunks = torch.cat([module.dequantize(a, min(a + 64, 200)) for a in range(0, 200, 64)])
    assert torch.equal(chunks, whole)
    ids = torch.tensor([[199, 0, 64, 127], [128, 191, 192, 5]])
    assert torch.equal(module.rows(ids), exact[ids])
    x = torch.randn(12, 64)
    expected = x.to(module.compute_dtype).float() @ whole.float().t()
    # ggml quantizes the activations to 8 bits inside its kernel, as llama.cpp does
    assert float((module(x) - expected).abs().max()) <= 1e-2 * float(expected.abs().max())


def dense_weight(attn, name: str) -> torch.Tensor:
    """A dense stage holds Q, K and V fused in one matrix; cut one back out."""
    if name == "wo":
        return attn.wo.weight
    q, kv = attn.n_heads * attn.head_dim, attn.n_kv_heads * attn.head_dim
    start, size = {"wq": (0, q), "wk": (q, kv), "wv": (q + kv, kv)}[name]
    return attn.wqkv.weight[start : start + size]


@pytest.mark.parametrize("weight_type", ["Q4_0", "Q4_K", "Q8_0", "Q6_K"])
def test_packed_stage_undoes_the_qk_interleave(weight_type):
    """The llama test model (a llama-arch GGUF, Q/K rows interleaved, width 256 so K-quants are
    real): packed Q and K hold the dequantized path's rows, in the same order."""
    model = open_model(model_path("llama", weight_type))
    assert model.qk_interleaved
    dense = load_stage(model, 0, 1, weights="dequant")
    for mode in ("packed", "compact"):
        packed = load_stage(model, 0, 1, weights=mode)
        for name in ("wq", "wk", "wv", "wo"):
            want = dense_weight(dense.blocks[0].attn, name)
            module = getattr(packed.blocks[0].attn, name)
            assert isinstance(module, packing.PackedLinear)
            got = module.gather(torch.arange(want.shape[0]))
            tolerance = (REQUANT_BOUND if module.fmt not in (EXACT.get(weight_type), "gguf") else 0.05) * rms(want)
            assert rms(got - want) <= tolerance, (mode, name, module.fmt)
            # and nothing looser than that for the rows of one head pair: the order is right
            assert float((got - want).abs().max()) < 0.5 * float(want.abs().max())


@pytest.mark.parametrize("name", ["llama", "qwen3", "llama3.1"])
def test_packed_stage_logits_close_to_dequantized(name):
    """Whole models: packed logits within bf16 reach of the dequantized path's (llama3.1 and qwen3
    tie their head to the embedding, which then serves both from one packed table)."""
    model = open_model(model_path(name, "Q4_0"))
    out = {}
    for mode in ("dequant", "packed"):
        stage = load_stage(model, 0, model.config.n_layers, weights=mode)
        stage.allocate_cache(1, 64)
        out[mode] = stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0]
        if mode == "packed" and model.config.tied_embeddings:
            assert stage.embed.table is stage.head
    spread = float(out["dequant"].max() - out["dequant"].min())
    assert float((out["packed"] - out["dequant"]).abs().max()) <= 0.02 * spread
    assert float((out["packed"] - out["dequant"]).abs().mean()) <= 0.002 * spread


@pytest.mark.parametrize("mode", ["dequant", "packed", "compact"])
@pytest.mark.parametrize("first,last,start,end", [(True, False, 0, 2), (False, True, 2, 4), (True, True, 0, 4)])
def test_planned_weight_bytes_are_what_the_stage_holds(mode, first, last, start, end):
    for name, weight_type in [("llama", "Q4_K"), ("qwen2", "Q8_0")]:
        model = open_model(model_path(name, weight_type))
        tensors = model.stage_tensors(start, end, first, last)
        stage = load_stage(model, start, end, first=first, last=last, weights=mode)
        formats = weight_formats(tensors, first, last, model.config.tied_embeddings, mode, "cpu", True, torch.float32)
        held = sum(p.nbytes for p in stage.parameters())
        assert weight_nbytes(tensors, formats, torch.float32) == held


def test_plan_auto_packs_and_falls_back_to_compact():
    model = open_model(model_path("llama", "Q6_K"))

    def plan(free, weights="auto"):
        return make_plan(
            model, [PlanDevice("w:1", "cpu", free, kernels=True)], ctx=64, prefill_chunk=16, weights=weights
        )

    roomy = plan(1 << 40)
    assert roomy.stages[0].weights == "fast" and roomy.stages[0].formats["Q6_K"].startswith("int8")
    compact = plan(1 << 40, "compact").stages[0]
    assert compact.formats["Q6_K"] == "gguf" and compact.weight_bytes < roomy.stages[0].weight_bytes
    tight = plan(compact.total_bytes + 1024)
    assert tight.stages[0].weights == "compact" and not tight.shortfalls()
    assert plan(compact.total_bytes - 1024).shortfalls()
    assert make_plan(model, [PlanDevice("w:1", "mps", 1 << 40)], ctx=64, weights="auto").stages[0].weights == "dequant"
    table = roomy.table()
    assert "fast (Q6_K:int8+gguf)" in table  # the matrices' format, and the embedding's


def test_the_plan_shows_whose_products_take_one_row_and_a_prompt_chunk_where_they_were_measured():
    model = open_model(model_path("llama", "Q8_0"))
    products, row_products = {"Q8_0": "shardwire", "F16": "ggml"}, {"Q8_0": "ggml"}
    device = PlanDevice("w:1", "cpu", 1 << 40, "bfloat16", True, {"Q8_0": "ggml"}, products, row_products)
    plan = make_plan(model, [device], ctx=64, prefill_chunk=16, weights="fast")
    assert plan.stages[0].formats == {"Q8_0": "ggml+gguf"}
    assert "fast (Q8_0:ggml+gguf/ggml-gemv/shardwire-gemm)" in plan.table()
    assert policy.held_label("F16", "ggml", {"F16": "ggml"}) == "F16:ggml/ggml-gemm"
    assert (
        policy.held_label("F16", "ggml", {"F16": "ggml"}, {"F16": "shardwire"}) == "F16:ggml/shardwire-gemv/ggml-gemm"
    )
    # own products multiply Q4_0 held repacked only, and no type they were not measured for
    assert policy.held_label("Q4_0", "gguf", {"Q4_0": "shardwire"}) == "Q4_0:gguf"
    assert policy.held_label("Q4_0", "repacked", {"Q4_0": "shardwire"}) == "Q4_0:repacked/shardwire-gemm"
    assert policy.held_label("Q4_K", "repacked", {"Q4_0": "shardwire"}) == "Q4_K:repacked"


def test_fast_takes_what_the_device_measured_and_auto_falls_back_when_it_does_not_fit():
    """fast holds each type as the device measured fastest for decode (dense Q8_0 here, as on a CPU
    whose bf16 product wins); when that does not fit, auto packs it (compact here: on a model this
    small the packed formats' dequantization workspace outweighs what they save). Without a
    measurement (CUDA) fast packs with PyTorch's kernels."""
    model = open_model(model_path("llama", "Q8_0"))

    def plan(free, fastest=(("Q8_0", "dense"),)):
        device = PlanDevice("w:1", "cpu", free, dtype="bfloat16", kernels=True, fastest=fastest)
        return make_plan(model, [device], ctx=64, prefill_chunk=16, weights="auto").stages[0]

    roomy = plan(1 << 40)
    assert roomy.weights == "fast" and roomy.formats["Q8_0"] == "dense"
    tight = plan(roomy.total_bytes - 1024)
    assert tight.weights in ("packed", "compact") and tight.formats["Q8_0"].startswith("int8x2")
    assert plan(1 << 40, ()).formats["Q8_0"].startswith("int8x2")
    ggml = plan(1 << 40, (("Q8_0", "ggml"),))
    assert ggml.formats["Q8_0"] == "ggml+gguf"  # the matrices, and the untied embedding's stored rows
    assert ggml.weight_bytes < roomy.weight_bytes
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", dtype=torch.bfloat16, fastest={"Q8_0": "dense"})
    assert all(
        isinstance(p, torch.nn.Parameter) and p.dtype == torch.bfloat16
        for n, p in stage.named_parameters()
        if n.endswith("wqkv.weight")
    )


def test_greedy_tokens_through_a_worker_equal_the_local_path(tmp_path):
    """The mode and the device's measured formats travel in the plan: an in-process worker builds
    the stages a local load with the same choices builds."""
    path = model_path("llama", "Q4_K")
    model = open_model(path)
    cluster = Cluster([], local_devices=["cpu"], cache_dir=tmp_path, show_progress=False)
    try:
        cluster.connect(model)
        plan = cluster.make_plan(ctx=128, weights="auto", dtype="float32")
        stage = plan.stages[0]
        measured = dict(stage.device.fastest)
        assert stage.weights == "fast" and stage.formats["Q4_K"].split("+")[0] == measured["Q4_K"]
        local = LocalPipeline([load_stage(model, 0, 4, weights="fast", fastest=measured)], n_slots=1, ctx=128)
        remote = cluster.load(plan)
        tokens = []
        for pipeline in (local, remote):
            engine = Engine(pipeline)
            handle = engine.submit(Request(PROMPT, GREEDY, max_tokens=16))
            handle.result()
            tokens.append(handle.tokens)
            engine.close()
        assert tokens[0] == tokens[1]
    finally:
        cluster.close()


ONE_ROW = {"dense": 2.0, "int4": 0.5, "ggml": 0.44, "repacked": 0.36}  # ms: one row's
INT4_FASTEST = ONE_ROW | {"int4": 0.3}


@pytest.mark.parametrize(
    "one_row,chunk,fastest",
    [
        # decodes 1.2x slower, reads a prompt 1.6x faster: serves a request of 4 prompt tokens per
        # generated one sooner (ggml's dequantized GEMM is slower here, its kernel counts)
        (ONE_ROW, {"int4": 40, "ggml": 4.7, "repacked": 7.7}, "ggml"),
        # a prompt only 1.1x faster does not make up for the slower decode
        (ONE_ROW, {"int4": 40, "ggml": 7.0, "repacked": 7.7}, "repacked"),
        # a PyTorch kernel decoding fastest is timed on a prompt too: slow there, it is not taken
        (INT4_FASTEST, {"int4": 40, "ggml": 4.7, "repacked": 7.7}, "ggml"),
        # ... and where its prompts are as fast, it is
        (INT4_FASTEST, {"int4": 5.0, "ggml": 4.7, "repacked": 7.7}, "int4"),
        # nothing decodes near the fastest: no prompt is timed
        ({"dense": 2.0, "int4": 0.6, "ggml": 0.3}, None, "ggml"),
    ],
)
def test_the_fastest_format_serves_a_request_soonest(monkeypatch, one_row, chunk, fastest):
    monkeypatch.setattr(measure, "MEASURED_TYPES", ("Q4_K",))
    monkeypatch.setattr(measure, "_candidates", lambda stored, dtype: dict.fromkeys(one_row, torch.nn.Identity()))
    monkeypatch.setattr(measure, "_prompt_takers", lambda candidates, near: [(f, candidates[f]) for f in near])
    timed = []

    def fastest_of(calls):
        timed.append(set(calls))
        return one_row if len(timed) == 1 else {f: chunk[f] for f in calls}  # milliseconds, as one_row

    monkeypatch.setattr(measure, "_fastest_of", fastest_of)
    entry = measure.measure("float32")["Q4_K"]
    assert entry["fastest"] == fastest
    assert timed[1:] == ([] if chunk is None else [set(chunk)])  # those within NEAR


@pytest.fixture
def quick_measurements(tmp_path, monkeypatch):
    """Kernel measurements on small matrices in short turns, kept in tmp_path."""
    monkeypatch.setenv("SHARDWIRE_CACHE", str(tmp_path))
    monkeypatch.setattr(measure, "SHAPE", (256, 256))
    monkeypatch.setattr(measure, "SECONDS", 0.002)
    monkeypatch.setattr(measure, "streamed_bytes", lambda: 1 << 20)
    return tmp_path


def test_fastest_formats_are_measured_once_per_machine_and_kept(quick_measurements):
    tmp_path = quick_measurements
    measure.fastest_formats.cache_clear()
    try:
        first = measure.fastest_formats("cpu", "float32")
        assert set(first) == set(measure.MEASURED_TYPES)
        assert all(f in ("dense", "ggml", "repacked", policy.FAST.get(t)) for t, f in first.items())
        assert measure._eviction_buffer.cache_info().currsize == 0  # its memory back once measured
        saved = json.loads((tmp_path / "kernels.json").read_text())
        ((key, kept),) = [(k, v) for k, v in saved.items() if "products" not in k]
        assert measure.cpu_model() in key and "float32" in key
        assert isinstance(kept["provisional"], bool) and kept["when"].endswith("UTC") and "cores" in kept["load"]
        entry = kept["result"]
        for timings in entry.values():
            one_row = timings["seconds"]
            fastest = min(one_row, key=one_row.get)
            if "prompt_seconds" in timings:  # of those decoding near the fastest, the one that
                chunk = timings["prompt_seconds"]  # serves a request soonest
                assert all(one_row[f] <= measure.NEAR * one_row[fastest] for f in chunk)
                cost = {f: measure.request_seconds(one_row[f], chunk[f]) for f in chunk}
                assert timings["fastest"] == min(cost, key=cost.get)
            else:
                assert timings["fastest"] == fastest
        entry["Q4_0"]["fastest"] = "dense"  # what is on disk is what a new process uses
        kept["provisional"] = False  # (one measured under load would be measured again)
        (tmp_path / "kernels.json").write_text(json.dumps(saved))
        measure.fastest_formats.cache_clear()
        assert measure.fastest_formats("cpu", "float32")["Q4_0"] == "dense"
        assert measure.fastest_formats("cuda:0", "bfloat16") == {}  # measured on CPUs only
    finally:
        measure.fastest_formats.cache_clear()


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
@pytest.mark.parametrize("weight_type", ["F16", "F32", "Q8_0", "Q4_K"])
def test_a_stage_on_ggml_kernels_computes_like_the_dense_float32_stage(weight_type):
    model = open_model(model_path("qwen3", weight_type))
    ids = torch.tensor([PROMPT])
    ref = load_stage(model, 0, 4, weights="dequant")
    ref.allocate_cache(1, 64)
    expected = ref(ids, [0], [0]).float()
    stage = load_stage(model, 0, 4, weights="fast", fastest={weight_type: "ggml"})
    assert any(isinstance(m, ggml_cpu.GGMLLinear) for m in stage.modules())
    stage.allocate_cache(1, 64)
    got = stage(ids, [0], [0]).float()
    spread = float(expected.max() - expected.min())
    assert float((got - expected).abs().max()) <= 0.03 * spread  # activations quantized inside the kernel


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
@pytest.mark.parametrize("dtype", ["Q4_K", "Q8_0"])
def test_ggml_matrices_switch_to_a_gemm_from_the_measured_row_count(dtype):
    w, raw, ref = matrix(dtype)
    module = pack_matrix(raw, dtype, "ggml", "cpu", torch.float32)
    assert module.gemm_rows == measure.gemm_rows(dtype, torch.float32)
    x = torch.randn(40, w.shape[1])
    module.gemm_rows = None
    by_ggml = module(x)
    module.gemm_rows = 10
    by_gemm = module(x)  # 40 rows >= 10: dequantized chunks into a float32 GEMM
    assert torch.allclose(by_gemm, x @ ref.t(), rtol=1e-4, atol=1e-4)
    assert float((by_ggml - by_gemm).abs().max()) <= 1e-2 * float(by_gemm.abs().max())


LAYOUTS = [
    "Q8_0 stored", "Q4_0 repacked", "F32 stored", "F16 stored", "BF16 stored", "Q4_K repacked", "Q4_K stored",
    "Q6_K stored",
]  # fmt: skip


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(
    "out_features,rows,cols",
    [(96, 16, 512), (96, 37, 512), (2048, 64, 512), (64, 23, 1056), (72, 64, 512), (80, 100, 2080)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_a_prompt_chunk_gives_each_row_what_its_one_row_product_gives(layout, out_features, rows, cols, threads):
    """A chunk of 16 rows or more on Q8_0, F32 or F16 weights, or on Q4_0 held repacked, goes to
    kernels/' products of 16 weight rows a vector where the CPU has AVX-512 (VNNI for the
    quantized ones; 72 rows of weights, not a whole number of its tiles, and other CPUs:
    tinyBLAS, the repacked GEMM); one row goes to kernels/' one-row products (Q8_0, F16; ggml's
    dot products where those are off or absent, and for F32) or the repacked GEMV. Both
    take the same activations (8-bit, or F16 for F16 weights, as ggml converts them; BF16's go to
    tinyBLAS and ggml's dot products, rounded to BF16), and the
    quantized ones sum exact integer products of blocks, each scaled by its two blocks' scales:
    they differ by float rounding only, whatever the tile, group of tiles or thread a weight row
    or activation row falls in (on 2 threads, the threads pack the activation rows together), and
    however many chunks of activation rows (64 a chunk) and blocks of K (2048 values a block) the
    float products take them in. Q4_K (either layout) and Q6_K: 16 weight rows a vector by Q8_K
    activations, each sub-block's exact integer sums scaled by its scales (the tiled products where
    that is off)."""
    stored, how = layout.split()
    if stored in ("Q4_K", "Q6_K") and cols % 256:
        pytest.skip("K-quant rows are whole 256-value blocks")
    w, raw, _ = matrix(stored, rows=out_features, cols=cols, seed=3)
    kind = ggml_cpu.GGMLLinear if how == "stored" else ggml_cpu.RepackedLinear
    module = kind(raw, stored, w.shape[1], torch.float32)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((rows, w.shape[1])).astype(np.float32))
    torch.set_num_threads(threads)
    try:
        chunk = module(x)
        one_at_a_time = torch.cat([module(x[i : i + 1]) for i in range(rows)])
    finally:
        torch.set_num_threads(1)
    assert float((chunk - one_at_a_time).abs().max()) <= 1e-5 * float(one_at_a_time.abs().max())


@pytest.mark.skipif(not ggml_cpu.own_products("gemv"), reason="no ggml with shardwire's own one-row products here")
@pytest.mark.parametrize("stored", ["Q8_0", "F16", "Q4_0", "Q4_K"])
@pytest.mark.parametrize("out_features,cols", [(97, 1056), (64, 96), (33, None), (2048, 512)])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_one_row_product_gives_what_ggmls_dot_products_give(stored, out_features, cols, threads):
    """kernels/' one-row products against ggml's dot products on the same graph, for K in whole
    steps of theirs and not (Q8_0: 4 blocks a step, here 33, 3 or 35 blocks; F16: 64 values, here
    1056, 96 and 1048), and weight rows that split unevenly between threads, with the same
    activations (8-bit, or rounded to F16, as ggml converts them). Q8_0 sums exact integer products
    of blocks, each scaled by its two blocks' scales, Q4_K (held repacked, 1024, 256, 1280 or 512
    values a row) each sub-block's by its 6-bit scale and takes its mins off: float rounding apart.
    F16, and Q4_0 held repacked (8 rows at a time: 96, 64, 32 or 2048 of them), add their products
    in the order ggml does: its bits (for Q4_0 those of the repacked GEMM too, so that a prompt
    caches the keys and values decoding its tokens did)."""
    cols = cols or {"Q8_0": 1120, "F16": 1048, "Q4_0": 1120, "Q4_K": 1280}[stored]
    if stored in ("Q4_0", "Q4_K"):
        out_features -= out_features % 8
    if stored == "Q4_K":
        cols = max(256, cols - cols % 256)
    w, raw, _ = matrix(stored, rows=out_features, cols=cols, seed=7)
    kind = ggml_cpu.RepackedLinear if stored in ("Q4_0", "Q4_K") else ggml_cpu.GGMLLinear
    module = kind(raw, stored, w.shape[1], torch.float32)
    x = torch.from_numpy(np.random.default_rng(8).standard_normal((1, w.shape[1])).astype(np.float32))
    torch.set_num_threads(threads)
    try:
        ggml_cpu.use_own_products([stored], "gemv")
        own = module(x)
        ggml_cpu.use_own_products([], "gemv")
        theirs = module(x)
    finally:
        ggml_cpu.use_own_products(ggml_cpu.own_products("gemv"), "gemv")
        torch.set_num_threads(1)
    if stored in ("F16", "Q4_0"):  # its sums in ggml's order
        assert torch.equal(own, theirs)
    else:  # its sums in another order
        assert not torch.equal(own, theirs)
        assert float((own - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


def lattice_blocks(stored: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """[rows, bytes a row] of IQ2_XXS or IQ3_XXS blocks: random lattice indices, signs and scales,
    under F16 scales (each block's first 2 bytes) of 1e-4 to 1e-2."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // 256, codecs.stored_nbytes(stored, (1, 256))), dtype=np.uint8)
    raw[..., :2] = rng.uniform(1e-4, 1e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8)
    return torch.from_numpy(raw.reshape(rows, -1))


@pytest.mark.parametrize("stored", ["IQ2_XXS", "IQ3_XXS"])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("threads", [1, 2])
def test_shardwires_lattice_dot_products_give_ggmls_bits_and_the_dequantized_product(stored, rows, threads):
    """kernels/lattice_dot.cpp stands in for ggml's IQ2_XXS and IQ3_XXS dot products wherever ggml
    calls them: a matrix's one row or a few, and the experts' rows. Its integer sums are ggml's and
    it adds them in ggml's order: ggml's bits, which are the dequantized weights' product to within
    the 8-bit activations' rounding."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    if stored not in ggml_cpu.own_products("gemv"):
        pytest.skip(f"no ggml with shardwire's {stored} dot product here (AVX-512 with VNNI, VBMI and BITALG)")
    raw = lattice_blocks(stored, 97, 1024, seed=3)
    module = ggml_cpu.GGMLLinear(raw, stored, 1024, torch.float32)
    shapes = ((512, 1024), (512, 1024), (1024, 512))  # gate, up, down of 4 experts: [rows, values a row]
    experts = ggml_cpu.GGMLExperts(
        *(lattice_blocks(stored, 4 * n, k, seed=s).view(4, n, -1) for s, (n, k) in enumerate(shapes)), (stored,) * 3
    )
    random = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 1024, generator=random)
    chosen = torch.randint(0, 4, (rows, 2), generator=random)
    weights = torch.rand(rows, 2, generator=random)
    torch.set_num_threads(threads)
    try:
        ggml_cpu.use_own_products([stored], "gemv")
        assert ggml_cpu.own_products_used("gemv") == (stored,)
        own = module(x), experts(x, chosen, weights)
        ggml_cpu.use_own_products([], "gemv")
        theirs = module(x), experts(x, chosen, weights)
    finally:
        ggml_cpu.use_own_products(ggml_cpu.own_products("gemv"), "gemv")
        torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(own, theirs))
    dense = x @ torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType[stored])).T
    assert float((own[0] - dense).abs().max()) <= 0.02 * float(dense.abs().max())


@pytest.mark.skipif(not ggml_cpu.available(), reason=f"no ggml here: {ggml_cpu.MISSING}")
@pytest.mark.parametrize("stored", ["Q8_0", "Q4_0", "Q4_K", "Q6_K", "F16"])
def test_ggml_quantizes_the_blocks_the_measurement_times_as_gguf_reads_them(stored):
    """The model-like weights the one-row measurement streams (measure.model_like) are ggml's own
    blocks: gguf reads them back within the type's error, and the same as the writer's where
    both round alike (Q8_0, Q4_0, F16)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    w, raw, ref = matrix(stored, rows=16, cols=512)
    raw = raw.view(torch.uint8)  # F16's are float16
    blocks = ggml_cpu.quantized(torch.from_numpy(w), stored)
    assert blocks.shape == raw.shape
    back = torch.from_numpy(dequantize(blocks.numpy(), GGMLQuantizationType[stored]))
    assert rms(back - torch.from_numpy(w)) <= 1.05 * rms(ref - torch.from_numpy(w)) + 1e-7
    if stored in ("Q8_0", "Q4_0", "F16"):
        assert torch.equal(blocks, raw)
    rows, _ = measure.SHAPE
    assert measure.model_like(stored).shape == (rows, codecs.stored_nbytes(stored, measure.SHAPE) // rows)
    with pytest.raises(ValueError, match="importance matrix"):
        ggml_cpu.quantized(torch.from_numpy(w), "IQ2_XXS")


@pytest.mark.skipif(not ggml_cpu.own_products(), reason="no ggml with shardwire's own products here")
@pytest.mark.parametrize(
    "layout,kind",
    [("Q8_0 stored", "gemm"), ("Q4_0 repacked", "gemm"), ("F32 stored", "gemm"), ("F16 stored", "gemm")]
    + [("Q4_K repacked", "gemm"), ("Q4_K stored", "gemm"), ("Q6_K stored", "gemm")]
    + [("Q8_0 stored", "gemv"), ("F16 stored", "gemv"), ("Q4_0 repacked", "gemv"), ("Q4_K repacked", "gemv")],
)
def test_a_product_switched_off_leaves_its_rows_to_ggml_on_the_same_plan(layout, kind):
    """Switched off after a graph was planned (as measuring them does), an own product leaves its
    rows (a chunk, or one row) to ggml's kernel on that same kept graph, and the other kind's
    switches stay as they were: the plan's work buffer holds what that kernel needs too (ggml's F16
    copy of the activations, which the F16 products make no room for)."""
    stored, how = layout.split()
    rows = measure.PRODUCT_ROWS[kind]
    w, raw, _ = matrix(stored, rows=64, cols=2048, seed=5)
    module = (ggml_cpu.GGMLLinear if how == "stored" else ggml_cpu.RepackedLinear)(
        raw, stored, w.shape[1], torch.float32
    )
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((rows, w.shape[1])).astype(np.float32))
    other = "gemm" if kind == "gemv" else "gemv"
    others = ggml_cpu.own_products_used(other)
    try:
        ggml_cpu.use_own_products([stored], kind)
        assert stored in ggml_cpu.own_products_used(kind)
        own = module(x)
        ggml_cpu.use_own_products([], kind)
        assert ggml_cpu.own_products_used(kind) == () and ggml_cpu.own_products_used(other) == others
        theirs = module(x)
    finally:
        ggml_cpu.use_own_products(ggml_cpu.own_products(kind), kind)
    if stored == "F16":
        assert module._graph("mul_mat", 64, rows).plan.work_size >= rows * 2048 * 2
    if (stored, kind) in (("F16", "gemv"), ("Q4_0", "gemv")):  # its sums in ggml's order
        assert torch.equal(own, theirs)
    elif (stored, kind) != ("Q4_0", "gemm"):  # the repack buffer's Q4_0 GEMM adds them in the same order
        assert not torch.equal(own, theirs)  # another kernel: its sums in another order
    assert float((own - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


@pytest.mark.parametrize("kind,named", [("gemm", "prompt products of 64 rows"), ("gemv", "one-row products")])
def test_own_products_are_measured_once_per_machine_kept_and_switched(quick_measurements, kind, named):
    tmp_path = quick_measurements
    measure.own_products.cache_clear()
    try:
        chosen = measure.own_products("cpu", "float32", kind)
        assert set(chosen) == set(ggml_cpu.own_products(kind))
        assert measure.own_products("cuda:0", "float32", kind) == {}
        if not chosen:
            return  # nothing to choose between with this ggml
        saved = json.loads((tmp_path / "kernels.json").read_text())
        ((key, kept),) = [(k, v) for k, v in saved.items() if named in k]
        assert measure.cpu_model() in key
        entry = kept["result"]
        for stored, timed in entry.items():
            assert set(timed["seconds"]) == {"shardwire", "ggml"}
            assert timed["fastest"] == chosen[stored] == min(timed["seconds"], key=timed["seconds"].get)
        assert set(ggml_cpu.own_products_used(kind)) == {t for t, whose in chosen.items() if whose == "shardwire"}
        entry["F16"]["fastest"], entry["Q8_0"]["fastest"] = "ggml", "shardwire"  # a new process uses the file's
        kept["provisional"] = False  # (one measured under load would be measured again)
        (tmp_path / "kernels.json").write_text(json.dumps(saved))
        measure.own_products.cache_clear()
        assert measure.own_products("cpu", "float32", kind)["F16"] == "ggml"
        assert "F16" not in ggml_cpu.own_products_used(kind) and "Q8_0" in ggml_cpu.own_products_used(kind)
    finally:
        measure.own_products.cache_clear()
        ggml_cpu.use_own_products(ggml_cpu.own_products(kind), kind)


def test_a_kept_measurement_this_version_cannot_use_is_measured_again(quick_measurements, caplog):
    """A kernels.json entry edited by hand, or written by another version, would reach the
    coordinator in the worker's DEVICES and be refused there: it is measured again instead."""
    path = quick_measurements / "kernels.json"
    measure.fastest_formats.cache_clear()
    measure.own_products.cache_clear()
    try:
        measure.fastest_formats("cpu", "float32")
        saved = json.loads(path.read_text())
        for key, entry in saved.items():
            (stored, first), *_ = entry["result"].items()
            first["fastest"] = "pickle"  # neither a weight format nor a product's source
        path.write_text(json.dumps(saved))
        measure.fastest_formats.cache_clear()
        measure.own_products.cache_clear()
        formats = measure.fastest_formats("cpu", "float32")
        assert all(f in WEIGHT_FORMATS for f in formats.values())
        for kind in ggml_cpu.OWN_PRODUCTS:
            assert all(
                whose in ("shardwire", "ggml") for whose in measure.own_products("cpu", "float32", kind).values()
            )
        assert "measuring again" in caplog.text
        assert "pickle" not in path.read_text()
        path.write_text("[1, 2]")  # not a map at all: measured afresh
        measure.fastest_formats.cache_clear()
        assert set(measure.fastest_formats("cpu", "float32")) == set(measure.MEASURED_TYPES)
    finally:
        measure.fastest_formats.cache_clear()
        measure.own_products.cache_clear()
        for kind in ggml_cpu.OWN_PRODUCTS:
            ggml_cpu.use_own_products(ggml_cpu.own_products(kind), kind)


def test_the_rows_where_a_gemm_wins_are_measured_once_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDWIRE_CACHE", str(tmp_path))
    monkeypatch.setattr(measure, "SHAPE", (128, 256))
    monkeypatch.setattr(measure, "SECONDS", 0.002)
    measure.gemm_rows.cache_clear()
    try:
        if not ggml_cpu.available():
            pytest.skip("ggml's kernels are not built here")
        rows = measure.gemm_rows("Q4_0", torch.float32)
        (kept,) = [v for k, v in json.loads((tmp_path / "kernels.json").read_text()).items() if "gemm rows Q4_0" in k]
        entry = kept["result"]
        times = entry["seconds"]
        wins = [int(n) for n in times if times[n]["gemm"] < times[n]["ggml"]]
        assert rows == entry["rows"] == (min(wins) if wins else None)
    finally:
        measure.gemm_rows.cache_clear()


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
def test_stored_bytes_leave_the_mapping_a_piece_at_a_time(monkeypatch):
    """A matrix held as stored is copied out of the file's mapping a piece at a time, each piece's
    pages dropped once copied, so that a large tensor is never resident twice while loading; the
    stage built is the same."""
    from shardwire.formats import TensorReader, tensors

    model = open_model(model_path("llama", "Q8_0"))
    fast = dict(weights="fast", fastest={"Q8_0": "ggml"})
    reference = load_stage(model, 0, 2, **fast)
    released = []

    class Reader(TensorReader):
        def release(self, info):
            released.append(info)
            super().release(info)

    monkeypatch.setattr(tensors, "COPY_PIECE", 4096)
    stage = load_stage(model, 0, 2, reader=Reader(), **fast)
    largest = max(model.stage_tensors(0, 2, True, False).values(), key=lambda t: t.nbytes)
    assert largest.dtype == "Q8_0" and largest.nbytes > 4 * 4096
    pieces = [r for r in released if largest.offset <= r.offset < largest.offset + largest.nbytes and r.nbytes <= 4096]
    assert [p.offset for p in pieces] == list(range(largest.offset, largest.offset + largest.nbytes, 4096))
    assert sum(p.nbytes for p in pieces) == largest.nbytes
    for s in (reference, stage):
        s.allocate_cache(1, 32)
    tokens = torch.tensor([PROMPT[:12]])
    assert torch.equal(reference(tokens, [0], [0], all_logits=True), stage(tokens, [0], [0], all_logits=True))


@pytest.mark.parametrize("stored", codecs.WIDENS)
def test_q4_0_and_q5_0_blocks_widen_to_q8_0_blocks_of_the_same_values(stored):
    """Each head's key and value matrices of a DeepSeek-V3 file may be held widened to Q8_0
    (latent.choose_widening): the same scale, the same integers, so every value is the stored one."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    values = torch.randn(48, 256, generator=torch.Generator().manual_seed(3))
    raw = ggml_cpu.quantized(values, stored)
    wide = codecs.widened_to_q8_0(raw, stored)
    assert wide.shape == (48, 256 // 32 * 34)
    shape = (48, 256)
    assert torch.equal(codecs.to_torch(wide.numpy(), "Q8_0", shape), codecs.to_torch(raw.numpy(), stored, shape))


def test_only_blocks_of_the_same_values_widen():
    with pytest.raises(codecs.QuantError, match="Q4_1 blocks do not widen"):
        codecs.widened_to_q8_0(torch.zeros(1, 20, dtype=torch.uint8), "Q4_1")
