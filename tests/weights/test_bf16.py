"""BF16 files (the big models' own weights, as published): held as stored and multiplied by ggml's
BF16 kernels where the measurement found them the fastest on this CPU, as every other stored type is;
the same file against llama.cpp is in tests/weights/test_codebook_llamacpp.py."""

import pytest
import torch

from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu, measure, policy

from models import model_path
from parity import assert_decoded_as_ggml_decodes, assert_near_the_dense_logits, decode_logits

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")


@pytest.fixture(scope="module")
def path():
    return model_path("llama", "BF16")


def test_every_bf16_tensor_decodes_as_ggml_decodes_it_bit_for_bit(path):
    for info in open_model(path).tensors.values():
        if info.dtype == "BF16":
            assert_decoded_as_ggml_decodes(info)


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


def test_bf16_held_as_stored_computes_what_its_float32_copy_does(path):
    """ggml's BF16 products (the activations rounded to BF16, as llama.cpp's) against the same
    weights widened to float32: a misread file would be off by the logits' whole spread."""
    model = open_model(path)
    held = load_stage(model, 0, model.config.n_layers, weights="fast", dtype=torch.float32, fastest={"BF16": "ggml"})
    assert any(isinstance(m, ggml_cpu.GGMLLinear) and m.stored == "BF16" for m in held.modules())
    dense = load_stage(model, 0, model.config.n_layers, weights="dequant", dtype=torch.float32, fastest={})
    assert_near_the_dense_logits(decode_logits(held), decode_logits(dense), 0.02)
