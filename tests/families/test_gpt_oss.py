"""gpt-oss (shardwire/models/gpt_oss.py): a tiny random model from transformers' own GptOssConfig
(attention sinks, blocks alternating between a sliding window and full attention, YaRN, biased
experts with the clamped SwiGLU), its folder as transformers saves it and as OpenAI publishes its
experts (MXFP4), and the GGUF llama.cpp's own converter writes from each, against transformers
float32 and llama.cpp's logits; in one process and on 2 workers split where a full block meets a
sliding one. Its chat goes through the file's harmony template: reasoning comes back apart, and a
call as a call."""

import asyncio
import dataclasses
import json
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest
import torch

from shardwire.backends import ggml as ggml_backend
from shardwire.backends.ggml import block as ggml_block
from shardwire.formats import open_model
from shardwire.formats.tensors import TensorReader
from shardwire.models import variant
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu

from models import converted_checkpoint, llama_cpp_logits, transformers_greedy
from parity import BACKENDS, assert_graphs_give_the_modules_outputs, greedy_tokens, our_logits
from runs import assert_same, distributed, single_process

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("shardwire_kit.convert")

# longer than the sliding window (4), so that the sliding blocks see less than the full ones
PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 632, 373]


def gpt_oss(form: str) -> Path:
    """The tiny gpt-oss's folder ("hf") or the converter's float32 GGUF of it ("gguf")."""
    return converted_checkpoint("gpt-oss", convert.tiny_gpt_oss, form)


@lru_cache(maxsize=None)
def reference():
    return transformers_greedy(gpt_oss("hf"), PROMPT)


@pytest.mark.parametrize("backend", BACKENDS)  # the parity matrix of test_model.py, gpt-oss's row
@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(form, backend):
    ref_logits, ref_tokens = reference()
    path = gpt_oss(form)
    ours = our_logits(path, PROMPT, backend)
    spread = float(ref_logits.max() - ref_logits.min())
    # without the sinks the logits part by 58% of a row's spread, without YaRN's gain on RoPE by 19%
    assert float((ours - ref_logits).abs().max()) <= 1e-3 * spread
    assert greedy_tokens(path, PROMPT, 16, backend) == ref_tokens


def test_llama_cpp_computes_the_converters_file_as_shardwire_does():
    theirs = llama_cpp_logits(gpt_oss("gguf"), PROMPT)
    ours = our_logits(gpt_oss("gguf"), PROMPT)
    spread = float(theirs.max() - theirs.min())
    assert float((ours - theirs).abs().max()) <= 1e-3 * spread
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_converters_file_reads_as_the_model_transformers_runs():
    cfg = open_model(gpt_oss("gguf")).config
    assert (cfg.sliding_window, cfg.sliding_blocks) == (4, (0, 2))  # llama.cpp's default: even blocks slide
    assert (cfg.n_experts, cfg.n_experts_used, cfg.expert_gating) == (8, 2, "top_k_softmax")
    assert (cfg.swiglu_limit, cfg.swiglu_alpha) == (7.0, 1.702)
    # YaRN's gain on cos and sin, as transformers' attention_factor: 0.1 ln(factor) + 1
    assert cfg.rope_scaling["type"] == "yarn" and math.isclose(
        cfg.rope_scaling["attention_factor"], 0.1 * math.log(4) + 1
    )
    assert str(variant(cfg, 0)) == "attention with sinks, a 4-key window, clamped_swiglu experts (top_k_softmax)"
    assert str(variant(cfg, 1)) == "attention with sinks, clamped_swiglu experts (top_k_softmax)"


def test_the_gguf_and_the_folder_read_as_one_model():
    """The folder says YaRN's ramp is not to be rounded (gpt-oss's config); llama.cpp rounds it,
    so the GGUF's scaling says nothing of it."""
    gguf, hf = open_model(gpt_oss("gguf")), open_model(gpt_oss("hf"))
    cfg = gguf.config
    assert cfg == dataclasses.replace(hf.config, norm_eps=cfg.norm_eps, rope_scaling=cfg.rope_scaling)
    assert hf.config.rope_scaling["truncate"] is False and "truncate" not in gguf.config.rope_scaling
    # transformers' experts (transposed, gate and up interleaved) read as the converter writes them
    reader = TensorReader()
    for name in ("blk.1.ffn_gate_exps.3.weight", "blk.1.ffn_up_exps.3.weight", "blk.1.ffn_down_exps.3.weight",
                 "blk.1.ffn_gate_exps.bias", "blk.1.ffn_up_exps.bias", "blk.1.attn_sinks.weight"):  # fmt: skip
        assert hf.tensors[name].shape == gguf.tensors[name].shape
        assert np.array_equal(reader.read(hf.tensors[name]), reader.read(gguf.tensors[name])), name


def test_a_folder_of_openai_s_mxfp4_experts_holds_the_converters_bytes_and_runs_as_its_gguf(tmp_path):
    """gpt-oss as OpenAI publishes it, its experts in MXFP4 blocks and scales apart: read as ggml's
    MXFP4, every expert's bytes those llama.cpp's converter writes from the same folder, and the
    logits the same."""
    folder = convert.openai_mxfp4(gpt_oss("hf"), tmp_path / "mxfp4")
    converted = convert.convert(folder, tmp_path / "mxfp4.gguf")
    hf, gguf = open_model(folder), open_model(converted)
    reader = TensorReader()
    experts = [name for name in hf.tensors if "_exps" in name]
    assert len(experts) == 4 * (3 * 8 + 3)  # a block's 8 experts' 3 matrices, and their 3 biases
    assert {hf.tensors[n].dtype for n in experts if n.endswith("weight")} == {"MXFP4"}
    for name in experts:
        assert hf.tensors[name].dtype == gguf.tensors[name].dtype
        assert np.array_equal(reader.read(hf.tensors[name]), reader.read(gguf.tensors[name])), name
    # to within the folder's unrounded YaRN ramp against the file's rounded one (0.04% of a pair here)
    ours, theirs = our_logits(folder, PROMPT), our_logits(converted, PROMPT)
    assert float((ours - theirs).abs().max()) <= 1e-4 * float(theirs.max() - theirs.min())


def test_ggmls_experts_add_their_biases_and_clamp_as_the_modules_do():
    """The experts held as stored under ggml (one graph for a block's chosen experts: biases added
    per expert, the clamped SwiGLU) give the logits of one PyTorch module per expert."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    model = open_model(gpt_oss("gguf"))
    modules = load_stage(model, 0, model.config.n_layers)
    grouped = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F32": "ggml"})
    experts = grouped.blocks[0].ffn.grouped
    assert isinstance(experts, ggml_cpu.GGMLExperts) and experts.clamped == (7.0, 1.702) and len(experts.biases) == 3
    assert modules.blocks[0].ffn.grouped is None
    outs = []
    for stage in (modules, grouped):
        stage.allocate_cache(1, 64)
        outs.append(stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0])
    assert float((outs[0] - outs[1]).abs().max()) <= 1e-4 * float(outs[0].max() - outs[0].min())


@pytest.mark.parametrize("stored", ["F32", "MXFP4"])
def test_ggmls_graphs_take_its_blocks_and_give_what_the_modules_give(stored, tmp_path):
    """Sinks, the sliding window (a prompt's rows each over its own window, a decode step's over
    the last 4 keys), YaRN's gain and the experts' routing, biases and clamp, in ggml's graphs
    and a stage's one-graph decode step, with keys and values in float16 as llama.cpp keeps them."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    path = gpt_oss("gguf")
    if stored == "MXFP4":
        path = convert.convert(convert.openai_mxfp4(gpt_oss("hf"), tmp_path / "mxfp4"), tmp_path / "mxfp4.gguf")
    model = open_model(path)
    assert all(ggml_backend.refusal(variant(model.config, i)) is None for i in range(model.config.n_layers))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={stored: "ggml", "F32": "ggml"})
    assert all(isinstance(b.runner, ggml_block.BlockGraphs) for b in stage.blocks)
    assert isinstance(stage.runner, ggml_block.StageGraph) and stage.runner.windows == [4]
    # a prompt past the window in two chunks; decode steps of a sequence past it and one inside it
    assert_graphs_give_the_modules_outputs(stage, (6, 4))


@pytest.mark.slow
@pytest.mark.parametrize("form", ["gguf", "hf"])  # the folder's experts are derived tensors, shipped as any other
def test_two_workers_split_where_a_full_block_meets_a_sliding_one_give_the_single_process_tokens(
    form, worker_pool, tmp_path
):
    path = gpt_oss(form)
    workers = worker_pool(2)
    # steps of at most 7 positions (the engine's prefill chunk): the sliding blocks keep 16 a sequence,
    # which the prompt and reply (36 positions) go round twice; the single process keeps every position
    addresses, chunk = [w.address for w in workers], dict(prefill_chunk=7)
    got, plan, _ = distributed(
        path, addresses, tmp_path / "coord", tensor_split=[1, 1], prompt=PROMPT, plan_options=chunk
    )
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4)]  # block 1 full, block 2 sliding
    assert plan.ring_step(open_model(path).config) == 13  # rings of 16 positions for the 4-key window
    assert_same(single_process(path, prompt=PROMPT), got)


def test_chat_renders_through_the_harmony_template_and_a_forced_call_comes_back_as_a_call():
    """The converter's GGUF carries gpt-oss's harmony template: a chat request renders through it
    (the tools in the developer turn, the reply opened for the assistant), harmony's message marks
    read as tokens and written back as text, and a named tool_choice makes the random model write a
    call, returned as tool_calls, over the real HTTP app in process."""
    from aiohttp import ClientSession

    from shardwire.serving.openai_api import parse_chat
    from shardwire.serving.reasoning import HARMONY
    from shardwire.serving.tools import HARMONY as HARMONY_CALLS
    from shardwire.serving.tools import call_syntax
    from shardwire.tokenizer import load_tokenizer

    from served import served
    from tool_calls import WEATHER

    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # a random model's keys end
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": closed}}
    model = open_model(gpt_oss("gguf"))
    tokenizer = load_tokenizer(model)
    assert call_syntax(tokenizer) == HARMONY_CALLS
    asked = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [weather]}
    job = parse_chat(asked, tokenizer)
    prompt = tokenizer.decode(job.prompts[0], skip_special=False)
    assert "namespace functions" in prompt and prompt.endswith("Weather in Rome?<|end|><|start|>assistant")
    assert job.reasoning == HARMONY
    # <|end|> ends a message, not the reply (as llama.cpp reads o200k_harmony); <|return|> and <|call|> do
    end, done, call = (
        tokenizer.encode(t, add_special=False, parse_special=True)[0] for t in ("<|end|>", "<|return|>", "<|call|>")
    )
    assert end not in tokenizer.stop_ids and {done, call} <= tokenizer.stop_ids
    marks = "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>final<|message|>ok"
    assert tokenizer.decode(tokenizer.encode(marks, add_special=False, parse_special=True)) == marks

    async def scenario():
        body = {**asked, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "max_tokens": 60}
        async with served(load_stage(model, 0, model.config.n_layers), tokenizer) as url, ClientSession() as http:
            async with http.post(
                f"{url}/v1/chat/completions", json={**body, "parallel_tool_calls": False, "seed": 1}
            ) as r:
                assert r.status == 200, await r.text()
                (choice,) = (await r.json())["choices"]
        assert choice["finish_reason"] == "tool_calls", choice
        (call,) = choice["message"]["tool_calls"]
        assert call["function"]["name"] == "get_weather"
        assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")

    asyncio.run(scenario())


def test_matrices_ot_keeps_apart_keep_their_biases():
    """-ot on gpt-oss's biased matrices (every expert's, and the queries'), each its own module
    (dequantized): a matrix kept on another device adds its bias there, and the experts' biases,
    which the pattern matches too, stay with the stage and reach the experts' products: the tokens
    are those of no -ot."""
    from shardwire.pipeline import LocalPipeline
    from shardwire.pipeline.loading import Placement

    from runs import generate

    model = open_model(gpt_oss("gguf"))
    apart = [Placement("ffn_.*_exps|attn_q", torch.device("cpu"), torch.float32, {})]

    def tokens(overrides):
        stage = load_stage(model, 0, model.config.n_layers, weights="dequant", overrides=overrides)
        return generate(LocalPipeline([stage], n_slots=1, ctx=256), n=12)[0]

    assert tokens(apart) == tokens(())
