"""GLM-4.5 (shardwire/models/glm4moe.py): a tiny random model from transformers' own config class,
its folder as transformers saves it and the GGUF llama.cpp's own converter writes from that folder,
against transformers float32 (and llama.cpp's logits on the GGUF); in one process and on 2 workers
split inside the run of expert blocks. ggml's graphs refuse its routing (sigmoid scores with a
bias, weights scaled) and its ungated shared expert: the modules compute those blocks."""

import dataclasses
import json
import logging
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from shardwire.backends import ggml as ggml_backend
from shardwire.backends.ggml import block as ggml_block
from shardwire.config import ConfigError
from shardwire.formats import open_model
from shardwire.models import variant
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu

from models import converted_checkpoint, llama_cpp_logits, transformers_greedy
from parity import BACKENDS, assert_graphs_give_the_modules_outputs, greedy_tokens, our_logits
from runs import assert_same, distributed, single_process

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("shardwire_kit.convert")

PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 632, 373]


def glm(form: str) -> Path:
    """The tiny GLM-4.5's folder ("hf") or the converter's float32 GGUF of it ("gguf")."""
    return converted_checkpoint("glm4moe", convert.tiny_glm4moe, form)


@lru_cache(maxsize=None)
def reference():
    return transformers_greedy(glm("hf"), PROMPT)


@pytest.mark.parametrize("backend", BACKENDS)  # the parity matrix of test_model.py, GLM-4.5's row
@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(form, backend):
    ref_logits, ref_tokens = reference()
    path = glm(form)
    ours = our_logits(path, PROMPT, backend)
    spread = float(ref_logits.max() - ref_logits.min())
    # without the choice bias or the weights' scale the logits part by about 40% of a row's spread
    assert float((ours - ref_logits).abs().max()) <= 5e-4 * spread
    assert greedy_tokens(path, PROMPT, 16, backend) == ref_tokens


def test_llama_cpp_computes_the_converters_file_as_shardwire_does():
    theirs = llama_cpp_logits(glm("gguf"), PROMPT)
    ours = our_logits(glm("gguf"), PROMPT)
    spread = float(theirs.max() - theirs.min())
    assert float((ours - theirs).abs().max()) <= 5e-3 * spread
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_gguf_and_the_folder_read_as_one_model():
    gguf, hf = open_model(glm("gguf")), open_model(glm("hf"))
    assert gguf.config == dataclasses.replace(hf.config, norm_eps=gguf.config.norm_eps)  # stored as float32
    cfg = gguf.config
    assert (cfg.expert_gating, cfg.expert_weights_scale, cfg.dense_blocks, cfg.rope_dim) == ("sigmoid", 2.5, (0,), 8)
    assert cfg.qk_norm and cfg.shared_expert_ffn_dim == cfg.expert_ffn_dim == 32
    assert {n: t.shape for n, t in gguf.tensors.items()} == {n: t.shape for n, t in hf.tensors.items()}
    assert str(variant(cfg, 1)) == (
        "attention with q/k norms, silu experts (sigmoid_biased_top_k_normalized, plain shared expert)"
    )


def test_multi_token_prediction_blocks_are_skipped_with_a_message(tmp_path, caplog):
    """GLM-4.5's checkpoints carry a block past the last that predicts a further token: shardwire
    (as transformers) does not run it."""
    folder = tmp_path / "glm-mtp"
    convert.tiny_glm4moe(folder, layers=5)  # its fifth block stands for the prediction block
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 4, "num_nextn_predict_layers": 1}))
    with caplog.at_level(logging.INFO, logger="shardwire.formats"):
        model = open_model(folder)
    assert model.config.n_layers == 4 and "skipping" in caplog.text and "multi-token-prediction" in caplog.text
    assert not any(name.startswith("blk.4.") for name in model.tensors)


def test_settings_it_does_not_compute_are_refused(tmp_path):
    folder = tmp_path / "glm"
    convert.tiny_glm4moe(folder, layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"topk_method": "greedy"}))
    with pytest.raises(ConfigError, match="topk_method 'greedy' is not supported"):
        open_model(folder)
    (folder / "config.json").write_text(json.dumps(config | {"n_group": 3}))  # 8 experts in 3 groups
    with pytest.raises(ConfigError, match="8 experts in 3 groups"):
        open_model(folder)


def test_ggmls_graphs_take_its_blocks_and_give_what_the_modules_give():
    """The dense block and the expert blocks (sigmoid scores, the routing bias where experts are
    chosen, the weights renormalized and scaled, the shared expert without a gate) in ggml's graphs
    and a stage's one-graph decode step."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    model = open_model(glm("gguf"))
    assert all(ggml_backend.refusal(variant(model.config, i)) is None for i in range(model.config.n_layers))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F32": "ggml"})
    assert all(isinstance(b.runner, ggml_block.BlockGraphs) for b in stage.blocks)
    assert isinstance(stage.runner, ggml_block.StageGraph)
    assert_graphs_give_the_modules_outputs(stage)


@pytest.mark.slow
def test_two_workers_split_inside_the_expert_blocks_give_the_single_process_tokens(worker_pool, tmp_path):
    path = glm("gguf")
    workers = worker_pool(2)
    got, plan, _ = distributed(
        path, [w.address for w in workers], tmp_path / "coord", tensor_split=[1, 1], prompt=PROMPT
    )
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4)]
    assert_same(single_process(path, prompt=PROMPT), got)


def test_chat_renders_through_the_files_own_template_and_a_forced_call_comes_back_as_a_call():
    """The converter's GGUF carries GLM's chat template: a chat request renders through it (tools
    in the system turn, the reply thinking by default), and a named tool_choice makes the random
    model write a call, returned as tool_calls, over the real HTTP app in process."""
    import asyncio

    from aiohttp import ClientSession

    from shardwire.serving.openai_api import parse_chat
    from shardwire.serving.tools import GLM, call_syntax
    from shardwire.tokenizer import load_tokenizer

    from served import served
    from tool_calls import WEATHER

    closed = {**WEATHER["function"]["parameters"], "additionalProperties": False}  # a random model's keys end
    weather = {"type": "function", "function": {**WEATHER["function"], "parameters": closed}}
    model = open_model(glm("gguf"))
    tokenizer = load_tokenizer(model)
    assert call_syntax(tokenizer) == GLM
    asked = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "tools": [weather]}
    job = parse_chat(asked, tokenizer)
    prompt = tokenizer.decode(job.prompts[0], skip_special=False)
    assert prompt.startswith("[gMASK]<sop><|system|>\n# Tools") and prompt.endswith("Weather in Rome?<|assistant|>")
    assert job.reasoning == ("<think>", "</think>")

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
