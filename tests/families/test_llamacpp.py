"""The same GGUF in llama.cpp and in shardwire's packed path: the trained glassllm model quantized by
llama.cpp's own llama-quantize (Q4_0, Q8_0, Q4_K_M; its width of 128 and FFN of 341 leave some
matrices F16 or on llama.cpp's fallback types), compared token by token. Skips unless llama.cpp
was built by benchmarks/build_llama_cpp.sh."""

import pytest

pytestmark = pytest.mark.slow  # worker processes

numerics = pytest.importorskip("benchmarks.numerics_llamacpp")
pytest.importorskip("glassllm")
if reason := numerics.unavailable():
    pytest.skip(reason, allow_module_level=True)

from benchmarks.packed_models import quantize  # noqa: E402

STEPS = 64
NEAR_TIE = 0.05  # logits: where llama.cpp's 8-bit activations may reorder the top two


@pytest.fixture(scope="module")
def glassllm_f32(tmp_path_factory):
    from shardwire_kit.glassllm import convert_glassllm

    return convert_glassllm(tmp_path_factory.mktemp("glassllm") / "glassllm-F32.gguf", "gguf", weight_type="F32")


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_K_M"])
def test_packed_glassllm_follows_llama_cpp(glassllm_f32, kind):
    path = quantize(glassllm_f32, glassllm_f32.with_name(f"glassllm-{kind}.gguf"), kind)
    for prompt in numerics.prompts_for("glassllm"):
        r = numerics.compare(path, prompt, STEPS, threads=1)
        numerics.report(r)
        for pair in ("packed vs llama.cpp", "packed vs dequant"):
            v = r[pair]
            assert v["top1_teacher_forced"] >= 60, (pair, v)
            assert v["mean_abs"] < 0.03 and v["max_abs"] < 0.5, (pair, v)
        # free-running, the two part only where llama.cpp's own top two are nearly tied
        v = r["packed vs llama.cpp"]
        if v["greedy_first_diff"] is not None:
            assert r["margins"][v["greedy_first_diff"]] < NEAR_TIE, (v, r["margins"][v["greedy_first_diff"]])


@pytest.mark.parametrize("weight_type", ["F32", "F16"])
def test_f32_and_f16_files_give_llama_cpp_greedy_tokens_by_default(tmp_path_factory, weight_type):
    """Without --dtype, an F32 or F16 file computes at its stored precision (float32 activations,
    F16 weights as stored, keys in float16 as llama.cpp keeps them), on the kernels this machine
    measured fastest: the same greedy continuation as llama.cpp."""
    from shardwire.devices import stored_precision_dtype
    from shardwire.formats import open_model
    from shardwire.weights.measure import fastest_formats
    from shardwire.weights.policy import default_dtype
    from shardwire_kit.glassllm import convert_glassllm

    path = convert_glassllm(
        tmp_path_factory.mktemp("plain") / f"glassllm-{weight_type}.gguf", "gguf", weight_type=weight_type
    )
    dtype = stored_precision_dtype(default_dtype("cpu"), "cpu", open_model(path).matrix_type)
    assert dtype == "float32"
    for prompt in numerics.prompts_for("glassllm"):
        n_ctx = len(prompt) + STEPS + 8
        with numerics.LlamaCpp(path, n_ctx, threads=1) as llama:
            theirs = llama.greedy(prompt, STEPS)
        ours = numerics.Shardwire(path, n_ctx, "fast", dtype, fastest_formats("cpu", dtype)).greedy(prompt, STEPS)
        assert ours == theirs, numerics.agreement(ours, theirs)
