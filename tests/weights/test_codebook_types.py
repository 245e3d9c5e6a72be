"""GGUF's codebook types (IQ1_S ... IQ4_XS, MXFP4: the types of unsloth's and bartowski's big-MoE
files), in any mix per tensor: read as stored, decoded bit for bit as ggml decodes them, multiplied by
ggml's kernels on the stored blocks, shown by the plan; a type shardwire does not read is a clear
error naming the tensor. The same files against llama.cpp are in tests/families/test_llamacpp.py."""

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

from shardwire.enums import CODEBOOK_TYPES, GROUPED_TYPES, QUANT_TYPES
from shardwire.formats import open_model
from shardwire.formats.gguf import GGUFError, read_gguf
from shardwire.pipeline.loading import load_stage
from shardwire.weights import codecs, ggml_cpu, policy
from shardwire_kit.synthetic import random_model, tiny_vocab_metadata
from shardwire_kit.writer import write_gguf

from parity import assert_decoded_as_ggml_decodes, assert_near_the_dense_logits, decode_logits

pytestmark = pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")

# rows of 256 values: the IQ types' super-blocks
LAYOUT = dict(arch="llama", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, ffn_dim=512, vocab_size=512, seed=3)
ALL_ON_GGML = {t: "ggml" for t in QUANT_TYPES}


@pytest.fixture(scope="module")
def source():
    return random_model(**LAYOUT)


@pytest.fixture(scope="module")
def files(source, tmp_path_factory):
    """One file per codebook type (every matrix, the token table too), and one mixing them per
    tensor as unsloth's UD- files do."""
    cfg, tensors = source
    folder = tmp_path_factory.mktemp("codebook")
    out = {}
    for t in CODEBOOK_TYPES:
        (out[t],) = write_gguf(folder / f"{t}.gguf", cfg, tensors, tiny_vocab_metadata(512), weight_type=t)
    mixed = {"attn_q": "IQ2_XXS", "attn_k": "IQ3_S", "attn_v": "IQ4_XS", "ffn_down": "MXFP4", "ffn_up": "IQ1_M"}

    def type_for(name, shape):
        return next((t for part, t in mixed.items() if part in name), "Q4_K")

    (out["mixed"],) = write_gguf(folder / "mixed.gguf", cfg, tensors, tiny_vocab_metadata(512), type_for=type_for)
    return out


def _raw(info) -> np.ndarray:
    return np.fromfile(info.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)


@pytest.mark.parametrize("stored", CODEBOOK_TYPES)
def test_every_tensor_decodes_as_ggml_decodes_it_bit_for_bit(files, stored):
    model = open_model(files[stored])
    types = set()
    for name, info in model.tensors.items():
        if info.dtype not in CODEBOOK_TYPES:
            continue
        types.add(info.dtype)
        assert_decoded_as_ggml_decodes(info)
    assert types == {stored}


def _decode_logits(path, weights: str, fastest: dict) -> torch.Tensor:
    model = open_model(path)
    stage = load_stage(model, 0, model.config.n_layers, weights=weights, dtype=torch.float32, fastest=fastest)
    return decode_logits(stage)


@pytest.mark.parametrize("stored", [*CODEBOOK_TYPES, "mixed"])
def test_blocks_held_as_stored_compute_what_the_dequantized_weights_do(files, stored):
    """ggml's kernels on the stored blocks (8-bit activations, as llama.cpp's) against the same
    weights dequantized to float32: a wrongly wired type would be off by the logits' whole spread."""
    held = _decode_logits(files[stored], "fast", ALL_ON_GGML)
    assert_near_the_dense_logits(held, _decode_logits(files[stored], "dequant", {}), 0.04)


def test_the_plan_holds_codebook_blocks_on_ggml_and_counts_their_stored_bytes(files):
    model = open_model(files["mixed"])
    fastest = {t: "ggml" for t in CODEBOOK_TYPES} | {t: "repacked" for t in GROUPED_TYPES}
    formats = policy.weight_formats(model.tensors, True, True, False, "fast", "cpu", True, fastest)
    for name, info in model.tensors.items():
        if info.dtype in CODEBOOK_TYPES:
            assert formats[name] == "ggml", name
            assert policy.weight_nbytes(model.tensors, {name: "ggml"}, torch.float32) == info.nbytes
    # where ggml's kernels do not run (another device, a CPU without them): dense in the compute dtype
    assert policy.matrix_format("IQ2_XXS", (256, 256), "compact", False, {}) == "dense"
    assert policy.matrix_format("MXFP4", (256, 256), "packed", True, {}) == "dense"


def test_a_codebook_token_table_is_gathered_through_ggml(files):
    """The embedding lookup reads rows of the stored blocks (no PyTorch decoder reads them)."""
    model = open_model(files["IQ4_XS"])
    info = model.tensors["token_embd.weight"]
    raw = _raw(info)
    table = ggml_cpu.GGMLLinear(torch.from_numpy(raw).view(info.shape[0], -1), "IQ4_XS", info.shape[1], torch.float32)
    ids = torch.tensor([3, 500, 3, 0])
    assert torch.equal(table.gather(ids), codecs.to_torch(raw, "IQ4_XS", info.shape)[ids])


def test_a_type_shardwire_does_not_read_is_refused_naming_the_tensor_and_the_type(tmp_path):
    path = tmp_path / "ternary.gguf"
    writer = GGUFWriter(str(path), "llama")
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType.TQ2_0]
    writer.add_tensor(
        "blk.0.ffn_up.weight", np.zeros((4, 256 // block * size), np.uint8), raw_dtype=GGMLQuantizationType.TQ2_0
    )
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.ffn_up\.weight' is stored as TQ2_0, a type shardwire"):
        read_gguf(path)


def test_the_codebook_types_are_the_ones_ggml_decodes_from_a_table():
    assert set(CODEBOOK_TYPES) <= {t.name for t in GGMLQuantizationType}
    with pytest.raises(codecs.QuantError, match="read by ggml or dequantized"):
        codecs.unpack(torch.zeros(1, 136, dtype=torch.uint8), "IQ4_XS")
