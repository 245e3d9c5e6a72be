"""BF16 files (the big models' own weights, as published): held as stored and multiplied by ggml's
BF16 kernels where the measurement found them the fastest on this CPU, as every other stored type is;
the same file against llama.cpp is in tests/weights/test_codebook_llamacpp.py."""

import numpy as np
import pytest
import torch

from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights import codecs, ggml_cpu, measure, policy

from models import PROMPT, model_path

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")


@pytest.fixture(scope="module")
def path():
    return model_path("llama", "BF16")


def test_every_bf16_tensor_decodes_as_ggml_decodes_it_bit_for_bit(path):
    for name, info in open_model(path).tensors.items():
        if info.dtype != "BF16":
            continue
        raw = np.fromfile(info.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        ours = codecs.to_torch(raw, info.dtype, info.shape).float()
        rows = torch.from_numpy(raw).view(info.shape[0], -1)
        ggmls = ggml_cpu.GGMLLinear(rows, info.dtype, info.shape[1], torch.float32).dequantize()
        assert torch.equal(ours.view(torch.int32), ggmls.view(torch.int32)), name


def test_the_measurement_times_bf16_and_the_plan_holds_it_as_measured(path):
    """Whichever format the measurement finds fastest for BF16 is the one the plan holds: the stored
    bytes where it is ggml's, a float32 copy (twice the bytes) where dense."""
    assert "BF16" in measure.MEASURED_TYPES
    model = open_model(path)
    matrices = {n: i for n, i in model.tensors.items() if i.dtype == "BF16" and len(i.shape) == 2}
    assert matrices
    for fastest, size in (({"BF16": "ggml"}, 1), ({"BF16": "dense"}, 2)):
        formats = policy.weight_formats(matrices, True, True, False, "fast", "cpu", True, fastest)
        assert set(formats.values()) == {fastest["BF16"]}
        held = policy.weight_nbytes(matrices, formats, torch.float32)
        assert held == size * sum(info.nbytes for info in matrices.values())


def _decode_logits(path, weights: str, fastest: dict) -> tuple[torch.Tensor, set]:
    """Logits after each token of PROMPT fed one at a time, and how the stage holds its matrices."""
    model = open_model(path)
    stage = load_stage(model, 0, model.config.n_layers, weights=weights, dtype=torch.float32, fastest=fastest)
    held = {(type(m).__name__, getattr(m, "stored", None)) for m in stage.modules() if hasattr(m, "in_features")}
    stage.allocate_cache(1, 64)
    logits = torch.stack([stage(torch.tensor([[t]]), [0], [i])[0, -1].float() for i, t in enumerate(PROMPT)])
    return logits, held


def test_bf16_held_as_stored_computes_what_its_float32_copy_does(path):
    """ggml's BF16 products (the activations rounded to BF16, as llama.cpp's) against the same
    weights widened to float32: a misread file would be off by the logits' whole spread."""
    held, kinds = _decode_logits(path, "fast", {"BF16": "ggml"})
    assert ("GGMLLinear", "BF16") in kinds
    dense, _ = _decode_logits(path, "dequant", {})
    spread = float((dense.max(-1).values - dense.min(-1).values).mean())
    worst = float((held - dense).abs().max())
    assert worst < 0.02 * spread, (worst, spread)
    top2 = dense.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * worst
    assert torch.equal(held.argmax(-1)[clear], dense.argmax(-1)[clear])
