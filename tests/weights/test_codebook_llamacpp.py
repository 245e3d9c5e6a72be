"""Files in the codebook types and BF16 as llama.cpp's own tools make them (llama-imatrix's importance
matrix, llama-quantize's per-tensor mixes: an IQ2_XXS file keeps some matrices Q2_K, an IQ1_S one Q5_K),
run by `shardwire generate`'s path: the greedy tokens llama.cpp gives. Skips unless llama.cpp was built by
benchmarks/build_llama_cpp.sh."""

import numpy as np
import pytest

from shardwire.enums import CODEBOOK_TYPES

from models import PROMPT, model_path

pytestmark = pytest.mark.slow  # llama.cpp in a child process, llama-quantize per type

numerics = pytest.importorskip("benchmarks.numerics_llamacpp")
if reason := numerics.unavailable():
    pytest.skip(reason, allow_module_level=True)

from benchmarks.packed_models import LLAMA_CPP, importance_matrix, quantize  # noqa: E402

if not (LLAMA_CPP / "bin" / "llama-imatrix").is_file():
    pytest.skip("this llama.cpp build has no llama-imatrix (benchmarks/build_llama_cpp.sh)", allow_module_level=True)

STEPS = 24
# the llama-quantize recipe that stores each type (its IQ2_S recipe stores IQ2_XS; MXFP4 is for
# experts only, as gpt-oss's, so a mixture of experts)
RECIPES = {t: t for t in (*CODEBOOK_TYPES, "BF16")} | {"IQ2_S": "IQ2_M", "MXFP4": "MXFP4_MOE"}


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama-quantize")

    def make(stored: str):
        source = model_path("mixtral" if stored == "MXFP4" else "llama", "F32")
        imatrix = importance_matrix(source, folder / f"{source.stem}.imatrix.gguf")
        return quantize(source, folder / f"{source.stem}-{stored}.gguf", RECIPES[stored], imatrix)

    return make


@pytest.mark.parametrize("stored", [*CODEBOOK_TYPES, "BF16"])
def test_llama_quantize_files_give_llama_cpp_greedy_tokens(quantized, stored):
    from shardwire.formats import open_model
    from shardwire.weights.measure import fastest_formats

    path = quantized(stored)
    assert stored in {info.dtype for info in open_model(path).tensors.values()}
    n_ctx = len(PROMPT) + STEPS + 8
    with numerics.LlamaCpp(path, n_ctx, threads=1) as llama:
        theirs = llama.greedy(PROMPT, STEPS)
        reference = llama.logits(PROMPT + theirs, len(PROMPT))
    ours = numerics.Shardwire(path, n_ctx, "fast", "float32", fastest_formats("cpu", "float32"))
    tokens = ours.greedy(PROMPT, STEPS)
    logits = ours.logits(PROMPT + theirs, len(PROMPT))
    differences = np.abs(logits - reference).max(-1)  # at each position
    spread = float((reference.max(-1) - reference.min(-1)).mean())
    if stored == "MXFP4":
        # a mixture of experts: where a router's k-th and next experts score within the two
        # engines' arithmetic of each other (this file has some 0.007 apart), one position runs
        # other experts and its logits part by a fifth of their spread; a misread block parts
        # every position
        assert np.median(differences) < 0.03 * spread, (differences, spread)
        assert (differences >= 0.03 * spread).sum() <= STEPS // 8, (differences, spread)
    else:
        assert differences.max() < 0.03 * spread, (differences, spread)
    same, first = numerics.agreement(tokens, theirs)
    if first is not None:  # they part only where llama.cpp's top two are within that position's difference
        top2 = np.sort(reference[first])[-2:]
        assert top2[1] - top2[0] < 2 * differences[first], (same, first, top2, differences[first])
