"""The CUDA paths: packed formats (PyTorch's CUDA int4 layout, int8x2, int8 and stored blocks
dequantized on the GPU), whole stages in bfloat16 on the GPU against the float32 CPU stage, the
KV cache's batched paths, and stages built by a worker on the GPU.

Skipped without CUDA; SHARDWIRE_TEST_DEVICE=cpu runs the same checks on the CPU (a dry run of
this file on a machine without a GPU)."""

import os

import numpy as np
import pytest
import torch

from shardwire.coordinator import Cluster
from shardwire.coordinator.launch import local_pipeline
from shardwire.devices import parse_dtype
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.model import Linear
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY
from shardwire.weights import codecs, policy
from shardwire.weights import packed as packing
from shardwire.weights.kernels import kernels_on
from shardwire.weights.pack import pack_matrix
from shardwire_kit.writer import quantize

from models import PROMPT, model_path

DEVICE = os.environ.get("SHARDWIRE_TEST_DEVICE") or ("cuda:0" if torch.cuda.is_available() else None)
if DEVICE is None:
    pytest.skip("no CUDA device (SHARDWIRE_TEST_DEVICE=cpu runs these here)", allow_module_level=True)


def stored(dtype: str, rows: int, cols: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(original float32 weights, stored rows as uint8 [rows, bytes]) of a random matrix."""
    w = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    data, qtype = quantize(w, dtype)
    assert qtype.name == dtype
    return torch.from_numpy(w), torch.from_numpy(data.reshape(rows, -1).copy())


def close(got: torch.Tensor, want: torch.Tensor, share: float) -> bool:
    return float((got.float().cpu() - want.float().cpu()).abs().max()) <= share * float(want.abs().max())


def rms(t: torch.Tensor) -> float:
    return float(t.double().pow(2).mean().sqrt())


TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]
EXACT = {("Q4_0", "int4"), ("Q4_1", "int4"), ("Q4_K", "int4"), ("Q8_0", "int8x2")}  # up to bf16 scales
REQUANT_BOUND = 0.5  # as test_quant: the rms error a requantized format adds, as a share of the type's own


@pytest.mark.parametrize("dtype", TYPES)
def test_stored_blocks_decode_on_the_device_bit_for_bit(dtype):
    _, raw = stored(dtype, 72, 512)
    want = codecs.unpack(raw, dtype).dequantize()
    assert torch.equal(codecs.unpack(raw.to(DEVICE), dtype).dequantize().cpu(), want)


# (type, format, rows, columns): 72 rows pad to 80, a 16-row tail; 64 and 96 columns take the
# CUDA layout's smaller k tiles (4 and 2 of 16 columns); K-quants need 256-column rows.
CASES = [
    ("Q4_0", "int4", 72, 512),
    ("Q4_0", "int4", 200, 64),
    ("Q4_0", "int4", 40, 96),
    ("Q4_1", "int4", 72, 512),
    ("Q4_K", "int4", 72, 512),
    ("Q3_K", "int4", 72, 512),
    ("Q2_K", "int4", 72, 512),
    ("Q8_0", "int8x2", 72, 512),
    ("Q8_0", "int8x2", 200, 64),
    ("Q6_K", "int8", 72, 512),
    ("Q8_0", "int8", 72, 512),
    ("Q4_0", "gguf", 72, 512),
    ("Q6_K", "gguf", 72, 512),
    ("Q8_0", "gguf", 200, 64),
]


@pytest.mark.parametrize("dtype,fmt,rows,cols", CASES)
def test_packed_matrix_on_the_device_multiplies_like_its_weights(dtype, fmt, rows, cols):
    """The device module's weights, read back as its product with the identity: what the same
    format holds on the CPU where the format is exact (requantizing rounds a few weights
    differently on the GPU, so there about as close to the stored weights as the CPU's); its
    products of 1, 9 and 300 rows (the kernel, a batch, a prefill chunk) equal x @ W^T."""
    w, raw = stored(dtype, rows, cols)
    ref = codecs.unpack(raw, dtype).dequantize()
    module = pack_matrix(raw, dtype, fmt, DEVICE, torch.bfloat16)
    assert all(p.device == torch.device(DEVICE) for p in module.parameters())
    held = module(torch.eye(cols, device=DEVICE, dtype=torch.bfloat16)).t().float().cpu()
    want = pack_matrix(raw, dtype, fmt, "cpu", torch.float32).gather(torch.arange(rows))
    if fmt == "gguf" or (dtype, fmt) in EXACT:
        assert close(held, want, 1e-2)
    else:  # requantized: about as far from the stored weights as the CPU's rounding
        assert rms(held - ref) <= 1.25 * rms(want - ref) + 2 * rms(ref.bfloat16().float() - ref)
        if policy.FAST[dtype] == fmt:
            assert rms(want - ref) <= REQUANT_BOUND * rms(ref - w)
    bias = torch.randn(rows, generator=torch.Generator().manual_seed(1))
    module.bias = torch.nn.Parameter(bias.to(DEVICE, torch.bfloat16), requires_grad=False)
    g = torch.Generator().manual_seed(0)
    for n in (1, 9, 300):
        x = torch.randn(n, cols, generator=g)
        y = module(x.to(DEVICE, torch.bfloat16))
        assert y.shape == (n, rows) and y.dtype == torch.bfloat16 and y.device == torch.device(DEVICE)
        expected = x.bfloat16().float() @ held.t() + bias
        assert close(y, expected, 2e-2), (n, float((y.float().cpu() - expected).abs().max()))
    if fmt not in ("int4", "int8x2") or DEVICE == "cpu":  # CUDA's int4 layout is not read back by rows
        ids = torch.tensor([[rows - 1, 0, 5], [rows // 2, 1, 2]], device=DEVICE)
        assert close(module.rows(ids), held[ids.cpu()], 1e-2)


@pytest.mark.parametrize("dtype,fmt", [("Q4_0", "int4"), ("Q8_0", "int8x2")])
def test_a_matrix_packed_in_chunks_of_rows_on_the_device_is_one_matrix(dtype, fmt, monkeypatch):
    """Large matrices are packed a chunk of rows at a time and the chunks' packed tensors joined:
    on CUDA the layout's first axis is tiles of 8 rows, so chunks of 64 rows join as one matrix."""
    _, raw = stored(dtype, 200, 64)
    whole = pack_matrix(raw, dtype, fmt, DEVICE, torch.bfloat16)
    monkeypatch.setattr(packing, "CHUNK_ELEMENTS", 64 * 64)
    chunked = pack_matrix(raw, dtype, fmt, DEVICE, torch.bfloat16)
    for a, b in zip(whole.planes, chunked.planes):
        assert torch.equal(a, b)
    assert torch.equal(whole.sz, chunked.sz)


def cpu_reference(path):
    model = open_model(path)
    stage = load_stage(model, 0, model.config.n_layers, weights="dequant")
    stage.allocate_cache(1, 64)
    return stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0]


STAGES = [
    ("llama", "F16"),
    ("llama", "Q4_0"),
    ("llama", "Q8_0"),
    ("llama", "Q4_K"),
    ("llama", "Q6_K"),
    ("qwen3", "Q4_0"),  # a tied head: packed, the embedding from the stored blocks
    ("qwen2", "Q8_0"),  # biases on Q, K and V
    ("mixtral", "Q4_0"),
    ("qwen3moe", "Q8_0"),
    ("qwen2moe", "Q4_0"),  # a shared expert
]


@pytest.mark.parametrize("mode", ["dequant", "packed", "compact"])
@pytest.mark.parametrize("name,weight_type", STAGES)
def test_a_stage_on_the_device_computes_like_the_float32_cpu_stage(name, weight_type, mode):
    path = model_path(name, weight_type)
    want = cpu_reference(path)
    model = open_model(path)
    stage = load_stage(model, 0, model.config.n_layers, device=DEVICE, dtype=torch.bfloat16, weights=mode)
    assert all(p.device == torch.device(DEVICE) for p in stage.parameters())
    if mode == "packed" and weight_type != "F16" and kernels_on(DEVICE):
        assert any(isinstance(m, packing.Int4Linear) for m in stage.modules()) or weight_type == "Q6_K"
    stage.allocate_cache(1, 64)
    got = stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0].cpu()
    spread = float(want.max() - want.min())
    moe = model.config.n_experts > 0  # bfloat16 may route a token to other experts: no bound per logit
    assert moe or float((got - want).abs().max()) <= 0.08 * spread
    assert float((got - want).abs().mean()) <= (0.02 if moe else 0.01) * spread
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.75


@pytest.mark.parametrize("name,weight_type", STAGES)
def test_a_float32_stage_on_the_device_equals_the_cpu_stage(name, weight_type):
    """Dequantized weights in float32 on the device: the same model, to float32 rounding."""
    path = model_path(name, weight_type)
    want = cpu_reference(path)
    model = open_model(path)
    stage = load_stage(model, 0, model.config.n_layers, device=DEVICE, dtype=torch.float32, weights="dequant")
    stage.allocate_cache(1, 64)
    got = stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0].cpu()
    assert float((got - want).abs().max()) <= 2e-3 * float(want.max() - want.min())


@pytest.mark.parametrize("name,weight_type,mode", [("llama", "Q4_0", "packed"), ("mixtral", "Q8_0", "packed")])
def test_batched_rows_on_the_device_equal_each_sequence_alone(name, weight_type, mode):
    """Rows in slots 3 and 0 (the cache's gather path) and in slots 0, 1 (its slice path), each at
    its own position, against each sequence run alone."""
    model = open_model(model_path(name, weight_type))
    stage = load_stage(model, 0, model.config.n_layers, device=DEVICE, dtype=torch.bfloat16, weights=mode)
    a, b = PROMPT[:6], PROMPT[3:12]
    alone = []
    for seq in (a, b):
        stage.allocate_cache(1, 64)
        alone.append(stage(torch.tensor([seq + [seq[-1] + 1]]), [0], [0])[0].cpu())
    for slots in ([3, 0], [0, 1]):
        stage.allocate_cache(4, 64)
        stage(torch.tensor([a]), [slots[0]], [0])
        stage(torch.tensor([b]), [slots[1]], [0])
        together = stage(torch.tensor([[a[-1] + 1], [b[-1] + 1]]), slots, [len(a), len(b)]).cpu()
        for got, want in zip(together, alone):
            spread = float(want.max() - want.min())
            assert float((got - want).abs().max()) <= 0.03 * spread, slots
        # two sequences' prompts in one step, at different lengths' worth of positions
        stage.allocate_cache(4, 64)
        both = stage(torch.tensor([a[:6], b[:6]]), slots, [0, 0], all_logits=True).cpu()
        assert both.shape == (2, 6, model.config.vocab_size)


def greedy(pipeline, prompts, n):
    engine = Engine(pipeline)
    try:
        handles = [engine.submit(Request(p, GREEDY, max_tokens=n)) for p in prompts]
        for h in handles:
            h.result()
            assert not h.error, h.error
        return [h.tokens for h in handles]
    finally:
        engine.close()


def agree(ours: list[int], path, prompt) -> None:
    """Greedy tokens equal the float32 CPU stage's, or part only where its two best tokens are
    within bfloat16's reach of each other."""
    model = open_model(path)
    ref = load_stage(model, 0, model.config.n_layers, weights="dequant")
    seq = list(prompt)
    for i, token in enumerate(ours):
        ref.allocate_cache(1, 128)
        logits = ref(torch.tensor([seq]), [0], [0])[0, -1]
        best = int(logits.argmax())
        if token != best:
            top = torch.topk(logits, 2).values
            assert float(top[0] - logits[token]) <= 0.02 * float(logits.max() - logits.min()), (i, token, best)
            return
        seq.append(token)


@pytest.mark.parametrize("name,weight_type", [("llama", "Q4_0"), ("qwen3moe", "Q4_0")])
def test_a_local_pipeline_on_the_device_decodes_greedily_like_the_cpu(name, weight_type):
    """What `shardwire bench -d cuda:0` and `generate` run: the plan's auto weights, two
    sequences decoded together."""
    path = model_path(name, weight_type)
    model = open_model(path)
    pipeline = local_pipeline(model, DEVICE, "bfloat16", "auto", n_slots=2, ctx=128)
    prompts = [PROMPT, PROMPT[4:]]
    together = greedy(pipeline, prompts, 12)
    for prompt, tokens in zip(prompts, together):
        agree(tokens, path, prompt)


def test_a_worker_builds_the_stage_a_local_load_builds_on_the_device(tmp_path):
    path = model_path("llama", "Q4_0")
    model = open_model(path)
    cluster = Cluster([], local_devices=[DEVICE], cache_dir=tmp_path, show_progress=False, tls=None)
    try:
        cluster.connect(model)
        plan = cluster.make_plan(ctx=128, weights="auto")
        stage = plan.stages[0]
        assert stage.device.name == DEVICE
        built = load_stage(
            model,
            0,
            4,
            device=DEVICE,
            dtype=parse_dtype(stage.device.dtype),
            weights=stage.weights,
            fastest=dict(stage.device.fastest),
        )
        local = LocalPipeline([built], n_slots=1, ctx=128)
        tokens = [greedy(p, [PROMPT], 16)[0] for p in (local, cluster.load(plan))]
        assert tokens[0] == tokens[1]
    finally:
        cluster.close()


def test_stages_on_the_device_and_the_cpu_hand_hidden_states_across(tmp_path):
    """Two stages through in-process workers, the first on the device, the second on the CPU."""
    if DEVICE == "cpu":
        pytest.skip("needs a device besides the CPU")
    path = model_path("llama", "Q8_0")
    model = open_model(path)
    cluster = Cluster([], local_devices=[DEVICE, "cpu"], cache_dir=tmp_path, show_progress=False, tls=None)
    try:
        cluster.connect(model)
        plan = cluster.make_plan(ctx=128, weights="auto", tensor_split=[1, 1])
        assert [s.device.name for s in plan.stages] == [DEVICE, "cpu"]
        (tokens,) = greedy(cluster.load(plan), [PROMPT], 12)
        agree(tokens, path, PROMPT)
    finally:
        cluster.close()


def test_dense_weights_on_the_device_use_the_compute_dtype():
    model = open_model(model_path("llama", "F16"))
    stage = load_stage(model, 0, 4, device=DEVICE, dtype=torch.bfloat16, weights="fast")
    linears = [m for m in stage.modules() if isinstance(m, Linear)]
    assert linears and all(m.weight.dtype == torch.bfloat16 for m in linears)


def test_attention_on_the_device_stays_off_cudnn():
    """cuDNN's attention builds a graph for every new KV length, once per thread (~40 ms each on
    an H200): decode ran ~5x slower until a thread had seen every length. A CUDA stage keeps
    attention on the other kernels."""
    if not DEVICE.startswith("cuda"):
        pytest.skip("CUDA only")
    model = open_model(model_path("llama", "Q4_0"))
    stage = load_stage(model, 0, 4, device=DEVICE, dtype=torch.bfloat16, weights="packed")
    stage.allocate_cache(1, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        stage(torch.tensor([PROMPT]), [0], [0])
        for i in range(4):
            stage(torch.tensor([[PROMPT[i]]]), [0], [len(PROMPT) + i])
    names = {e.key for e in prof.key_averages()}
    assert "aten::scaled_dot_product_attention" in names
    assert not any("cudnn_attention" in n for n in names), sorted(n for n in names if "attention" in n)
