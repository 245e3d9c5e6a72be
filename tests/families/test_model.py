"""Our forward pass against transformers on the same weights, for every family's test models, on
every backend this machine has (the reference path, PyTorch's modules, everywhere; ggml's graphs
where ggml is built): the backend parity matrix."""

import os

import pytest
import torch

from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage

from models import NAMES, PROMPT, hf_path, model_path
from parity import BACKENDS, float32_stage, greedy_tokens, our_logits

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")


def reference(name: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_path(name), dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module", params=NAMES)
def arch(request):
    name = request.param
    ref = reference(name)
    with torch.no_grad():
        logits = ref(torch.tensor([PROMPT])).logits[0]
        generated = list(PROMPT)
        for _ in range(32):  # plain argmax: generate() would hold back end-of-sequence tokens
            generated.append(int(ref(torch.tensor([generated])).logits[0, -1].argmax()))
    return name, logits, generated[len(PROMPT) :], ref


def assert_same_greedy(ref, ours: list[int], theirs: list[int]) -> None:
    """Identical, or parting only where the reference's two best tokens tie to within float32
    rounding (random-weight models meet such ties now and then)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            with torch.no_grad():
                logits = ref(torch.tensor([PROMPT + theirs[:i]])).logits[0, -1]
            first, second = torch.topk(logits, 2).values.tolist()
            assert first - second <= 1e-4 * float(logits.max() - logits.min()), (
                f"step {i}: {a} != {b} although the reference's margin is {first - second:.5f}"
            )
            return


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["gguf", "safetensors"])
def test_logits_and_greedy_match_transformers(arch, form, backend):
    name, ref_logits, ref_tokens, ref = arch
    path = model_path(name, "F32") if form == "gguf" else hf_path(name)
    ours = our_logits(path, PROMPT, backend)
    spread = float(ref_logits.max() - ref_logits.min())
    assert float((ours - ref_logits).abs().max()) <= 1e-4 * spread
    if backend != "reference":
        assert float((ours - our_logits(path, PROMPT, "reference")).abs().max()) <= 1e-4 * spread
    assert_same_greedy(ref, greedy_tokens(path, PROMPT, 32, backend), ref_tokens)


@pytest.mark.parametrize("weight_type", ["F16", "Q8_0", "Q4_0", "Q4_K"])
def test_quantized_gguf_matches_transformers_on_the_same_file(weight_type):
    """transformers dequantizes GGUF with the gguf package, and undoes llama.cpp's Q/K row order
    of llama-arch files; so do we."""
    path = model_path("llama", weight_type)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        ref_logits = ref(torch.tensor([PROMPT])).logits[0]
    ours = our_logits(path, PROMPT)
    spread = float(ref_logits.max() - ref_logits.min())
    assert float((ours - ref_logits).abs().max()) <= 1e-4 * spread


def test_incremental_decode_equals_full_forward():
    stage = float32_stage(model_path("qwen3", "F32"))  # float16 keys would round the paths' last bits apart
    stage.allocate_cache(3, 64)
    full = stage(torch.tensor([PROMPT]), [1], [0], all_logits=True)[0]
    stage.allocate_cache(3, 64)
    parts = [stage(torch.tensor([PROMPT[:5]]), [2], [0], all_logits=True)[0]]
    for i in range(5, len(PROMPT)):
        parts.append(stage(torch.tensor([[PROMPT[i]]]), [2], [i], all_logits=True)[0])
    # 16 rows, 5 and 1 go through three kernels (a tile product, tinyBLAS, dot products) that sum
    # each product's terms in their own order: equal to float rounding over the blocks
    assert torch.allclose(torch.cat(parts), full, atol=5e-5, rtol=1e-4)


def test_batch_of_sequences_at_different_positions():
    """Rows of one batch sit at different positions and slots; each equals its own run alone."""
    stage = float32_stage(model_path("llama", "F32"))  # float16 keys would round the runs' last bits apart
    a, b = PROMPT[:6], PROMPT[3:12]
    stage.allocate_cache(4, 64)
    stage(torch.tensor([a]), [3], [0])
    stage(torch.tensor([b]), [0], [0])
    together = stage(torch.tensor([[a[-1] + 1], [b[-1] + 1]]), [3, 0], [len(a), len(b)])
    stage.allocate_cache(1, 64)
    alone_a = stage(torch.tensor([a + [a[-1] + 1]]), [0], [0])
    stage.allocate_cache(1, 64)
    alone_b = stage(torch.tensor([b + [b[-1] + 1]]), [0], [0])
    assert torch.allclose(together[0], alone_a[0], atol=1e-5)
    assert torch.allclose(together[1], alone_b[0], atol=1e-5)


def test_split_stages_chain_to_the_whole_model():
    model = open_model(model_path("mistral", "F16"))
    whole = load_stage(model, 0, 4)
    parts = [load_stage(model, 0, 1), load_stage(model, 1, 3), load_stage(model, 3, 4)]
    for s in [whole, *parts]:
        s.allocate_cache(1, 64)
    x = torch.tensor([PROMPT])
    expected = whole(x, [0], [0])
    for s in parts:
        x = s(x, [0], [0])
    assert torch.allclose(x, expected, atol=1e-5)
