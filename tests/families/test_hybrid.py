"""Qwen3.5 hybrids (qwen35, qwen35moe): gated delta-net blocks with a recurrent state per slot,
gated attention, files as llama.cpp's converter and transformers write them. Agreement with
transformers (GGUF and safetensors, one process) is in test_model.py, whose model set has both;
across workers and through a lost worker here."""

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from shardwire.backends.ggml import block as ggml_block
from shardwire.backends.ggml.deltanet import DeltaNetGraphs
from shardwire.config import ConfigError
from shardwire.deltanet import GatedDeltaNet, chunked_delta_rule, recurrent_delta_rule
from shardwire.engine import Engine, Request
from shardwire.formats import ModelError, open_model
from shardwire.kvcache import RecurrentState, stage_cache_nbytes
from shardwire.models import config_from_dict
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.pipeline.plan import PlanDevice, make_plan
from shardwire.sampling import SamplingParams
from shardwire.weights import ggml_cpu
from shardwire_kit.writer import gguf_config, write_gguf

from models import PROMPT, hf_path, llama_cpp_logits, model_path, model_source
from parity import assert_graphs_give_the_modules_outputs
from runs import assert_same, distributed, single_process

GREEDY = SamplingParams(temperature=0.0)


def whole(path, **kw):
    model = open_model(path)
    return load_stage(model, 0, model.config.n_layers, **kw)


def test_gguf_as_llama_cpps_converter_writes_it():
    """qwen35 keys, the pre-FFN norm as post_attention_norm, A as -exp(A_log), norms as 1 + w,
    the short convolution as [taps, channels] in ggml order; read back to the model's config."""
    cfg, tensors, _ = model_source("qwen35")
    path = model_path("qwen35", "Q8_0")
    stored = {t.name: t for t in GGUFReader(path).tensors}
    meta = open_model(path).metadata
    assert meta["general.architecture"] == "qwen35"
    assert meta["qwen35.full_attention_interval"] == 4
    assert (meta["qwen35.ssm.group_count"], meta["qwen35.ssm.time_step_rank"]) == (2, 6)
    assert (meta["qwen35.ssm.state_size"], meta["qwen35.ssm.inner_size"]) == (16, 96)
    assert meta["qwen35.rope.dimension_count"] == 16 and len(meta["qwen35.rope.dimension_sections"]) == 4
    assert "blk.0.post_attention_norm.weight" in stored and "blk.0.ffn_norm.weight" not in stored
    assert "blk.3.attn_qkv.weight" not in stored and [int(d) for d in stored["blk.3.attn_q.weight"].shape] == [64, 512]
    conv = stored["blk.0.ssm_conv1d.weight"]
    assert [int(d) for d in conv.shape] == [4, cfg.conv_channels] and conv.tensor_type.name == "F32"
    assert np.all(np.asarray(stored["blk.0.ssm_a"].data) < 0)
    assert stored["blk.0.ssm_beta.weight"].tensor_type.name == "Q8_0"
    np.testing.assert_allclose(np.asarray(stored["output_norm.weight"].data), tensors["output_norm.weight"] + 1)
    model = open_model(path)
    assert model.config == gguf_config(cfg) and not model.config.hf_layout
    assert "blk.0.ffn_norm.weight" in model.tensors
    assert open_model(hf_path("qwen35")).config == cfg and cfg.hf_layout


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_transformers_and_gguf_forms_build_the_same_model(name):
    """The safetensors folder (transformers' values) and the F32 GGUF (the converter's) give the
    same tensors once loaded, value heads tiled in both."""
    a, b = whole(hf_path(name)), whole(model_path(name, "F32"))
    for (n, x), (m, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert n == m
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=n)


def test_chunked_and_recurrent_delta_rules_agree():
    """Prefill's chunked form (several chunks, a last partial one, a starting state) computes
    what decode's one-token-at-a-time form does."""
    g = torch.Generator().manual_seed(0)
    B, H, T, Dk, Dv = 2, 3, 150, 16, 8
    q = torch.nn.functional.normalize(torch.randn(B, H, T, Dk, generator=g), dim=-1) * Dk**-0.5
    k = torch.nn.functional.normalize(torch.randn(B, H, T, Dk, generator=g), dim=-1)
    v = torch.randn(B, H, T, Dv, generator=g)
    decay = -torch.rand(B, H, T, generator=g)
    beta = torch.rand(B, H, T, generator=g)
    state = torch.randn(B, H, Dv, Dk, generator=g)
    out_c, state_c = chunked_delta_rule(q, k, v, decay, beta, state)
    out_r, state_r = recurrent_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(out_c, out_r, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state_c, state_r, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_prefill_in_chunks_then_decode_equals_one_full_forward(name):
    stage = whole(model_path(name, "F32"))
    stage.allocate_cache(3, 64)
    full = stage(torch.tensor([PROMPT]), [1], [0], all_logits=True)[0]
    parts = [stage(torch.tensor([PROMPT[:5]]), [2], [0], all_logits=True)[0]]
    parts.append(stage(torch.tensor([PROMPT[5:9]]), [2], [5], all_logits=True)[0])
    for i in range(9, len(PROMPT)):
        parts.append(stage(torch.tensor([[PROMPT[i]]]), [2], [i], all_logits=True)[0])
    spread = float(full.max() - full.min())  # float32 rounding, in the experts' sums too
    assert float((torch.cat(parts) - full).abs().max()) <= 1e-4 * spread


needs_ggml = pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")


@needs_ggml
@pytest.mark.parametrize("name,stored", [("qwen35moe", "Q8_0"), ("qwen35", "F16")])
def test_a_delta_net_blocks_rows_run_in_ggml_as_the_modules_run_them(name, stored):
    """A decode step of the stage's blocks, delta-net and gated attention, runs in one ggml graph;
    a prompt's rows run a delta-net block's mixer in the modules and its feed-forward half
    (experts and the shared expert, or a dense one) in a graph, more rows than a graph takes a
    piece at a time: the logits of a prompt and of decode steps (of 2 sequences, and of 9: pieces
    of 8 and 1) are the modules'."""
    stage = whole(model_path(name, stored), weights="fast", fastest={stored: "ggml", "F32": "ggml"})
    linear = [b for b in stage.blocks if isinstance(b.attn, GatedDeltaNet)]
    assert linear and all(isinstance(b.runner, DeltaNetGraphs) for b in linear)
    assert all(isinstance(b.feed_runner, ggml_block.FeedForwardGraphs) for b in linear)
    assert isinstance(stage.runner, ggml_block.StageGraph) and stage.runner.logits
    for b in linear:
        b.feed_runner.piece = 8
    assert_graphs_give_the_modules_outputs(stage)


@needs_ggml
@pytest.mark.parametrize("name,stored", [("qwen35moe", "Q8_0"), ("qwen35", "F32")])
@pytest.mark.parametrize("one_graph", [True, False])
def test_a_delta_net_decode_step_leaves_each_slot_the_state_the_modules_leave(name, stored, one_graph):
    """A prompt read in ggml's graphs a piece at a time (of 2 rows: 2, 2, 1), then two sequences
    in slots out of order stepping together, in the stage's one graph or in each block's: each
    slot's convolution inputs and delta-rule state afterwards are what the modules leave in a
    copy of it, and the logits theirs."""
    stage = whole(model_path(name, stored), weights="fast", fastest={stored: "ggml", "F32": "ggml"})
    if not one_graph:
        stage.runner = None
    for b in stage.blocks:
        if b.feed_runner is not None:
            b.feed_runner.piece = 2
    stage.allocate_cache(6, 32)
    prompt = torch.tensor([PROMPT[:5]])
    step = torch.tensor([[PROMPT[5]], [PROMPT[6]]])
    read = [stage(prompt, [slot], [0]) for slot in (0, 2)]
    in_graphs = stage(step, [2, 0], [5, 5])
    stage.runner = None
    for b in stage.blocks:
        b.runner = b.feed_runner = None
    read_by_modules = [stage(prompt, [slot], [0]) for slot in (3, 5)]
    by_modules = stage(step, [5, 3], [5, 5])
    for ours, theirs in ((read[0], read_by_modules[0]), (in_graphs, by_modules)):
        assert float((ours - theirs).abs().max()) <= 2e-3 * float(theirs.abs().max())
        assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    state = stage.cache.recurrent
    for mine, theirs in ((2, 5), (0, 3)):  # the rounding of 6 positions through 5 blocks
        for held in (state.delta, state.conv):
            scale = float(held[:, theirs].abs().max())
            torch.testing.assert_close(held[:, mine], held[:, theirs], rtol=0, atol=1e-4 * scale)
    assert not torch.equal(state.delta[:, 2], state.delta[:, 0])


def test_rows_of_a_batch_keep_their_own_state():
    """Sequences in other slots at other positions, decoded together, each as alone; slots in
    any order (a gather, not a slice). Within float16's rounding: attention rounds its queries and
    weights to float16 (as llama.cpp does with a float16 cache), which turns the last-bit
    differences of a batched product into a float16 step now and then."""
    stage = whole(model_path("qwen35", "F32"))
    a, b = PROMPT[:6], PROMPT[3:12]
    stage.allocate_cache(4, 64)
    stage(torch.tensor([a]), [3], [0])
    stage(torch.tensor([b]), [0], [0])
    together = stage(torch.tensor([[a[-1] + 1], [b[-1] + 1]]), [3, 0], [len(a), len(b)])
    then = stage(torch.tensor([[7], [9]]), [3, 0], [len(a) + 1, len(b) + 1])
    for prompt, row in ((a, 0), (b, 1)):
        stage.allocate_cache(1, 64)
        alone = stage(torch.tensor([prompt + [prompt[-1] + 1]]), [0], [0])
        torch.testing.assert_close(together[row], alone[0], atol=1e-3, rtol=1e-3)
        alone = stage(torch.tensor([[(7, 9)[row]]]), [0], [len(prompt) + 1])
        torch.testing.assert_close(then[row], alone[0], atol=1e-3, rtol=1e-3)


def same_but_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    """Equal but for float32 rounding: a product of several rows rounds otherwise than of one
    (a refused proposal folded into the state would differ by far more)."""
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-4 * float(theirs.abs().max()))


@pytest.mark.parametrize("in_graphs", [True, False], ids=["graphs", "modules"])
def test_a_step_that_checks_proposals_can_be_taken_back_to_any_of_its_positions(in_graphs):
    """A step with proposals (all logits) keeps the state from before it: the next step may start
    at any of its positions (the proposals before it kept), and the stage feeds the kept ones
    again; the logits and state are those of a sequence that never saw the refused ones. A start
    past the step, or before it, is refused."""
    stage = whole(model_path("qwen35", "F32"))
    if not in_graphs:
        stage.runner = None
        for b in stage.blocks:
            b.runner = b.feed_runner = None
    stage.allocate_cache(2, 64)
    n, tokens = len(PROMPT), [5, 6, 7, 8, 9]
    for slot in (0, 1):
        stage(torch.tensor([PROMPT]), [slot], [0])
    checked = stage(torch.tensor([tokens]), [0], [n], all_logits=True)
    for i, token in enumerate(tokens[:2]):  # the sequence that kept two proposals, decoded one at a time
        alone = stage(torch.tensor([[token]]), [1], [n + i])
        same_but_rounding(checked[0, i], alone[0, 0])
    state = stage.cache.recurrent
    again = stage(torch.tensor([[11]]), [0], [n + 2])  # 7 refused: 11 drawn there instead
    same_but_rounding(again, stage(torch.tensor([[11]]), [1], [n + 2]))
    same_but_rounding(state.delta[:, 0], state.delta[:, 1])
    same_but_rounding(state.conv[:, 0], state.conv[:, 1])
    assert state.consumed[0] == n + 3
    with pytest.raises(ValueError, match="cannot be rewound"):  # the copy went with the step it was kept for
        stage(torch.tensor([[12]]), [0], [n + 1])
    stage(torch.tensor([tokens]), [0], [n + 3], all_logits=True)
    with pytest.raises(ValueError, match="cannot be rewound"):
        stage(torch.tensor([[1]]), [0], [n + 2])
    with pytest.raises(ValueError, match="cannot be rewound"):
        stage(torch.tensor([[1]]), [0], [n + 9])


def test_a_slot_reused_from_position_0_starts_from_a_clean_state_and_never_rewinds():
    stage = whole(model_path("qwen35", "F32"))
    stage.allocate_cache(1, 64)
    first = stage(torch.tensor([PROMPT]), [0], [0])
    stage(torch.tensor([[1]]), [0], [len(PROMPT)])
    assert stage(torch.tensor([PROMPT]), [0], [0]).equal(first)  # a new sequence in the same slot
    state = stage.cache.recurrent
    assert state.consumed[0] == len(PROMPT)
    with pytest.raises(ValueError, match="cannot be rewound"):
        stage(torch.tensor([[1]]), [0], [3])
    with pytest.raises(ValueError, match="cannot be rewound"):
        stage(torch.tensor([[1]]), [0], [len(PROMPT) + 5])


def test_the_plan_counts_the_recurrent_state():
    model = open_model(model_path("qwen35moe", "F32"))
    cfg = model.config
    device = PlanDevice("w0", "cpu", 1 << 40)
    (planned,) = make_plan(model, [device], n_slots=3, ctx=64).stages
    per_slot = cfg.conv_channels * (cfg.ssm_conv_kernel - 1) * 4 + cfg.ssm_v_heads * cfg.ssm_k_dim * cfg.ssm_v_dim * 4
    kv = 2 * 3 * cfg.n_kv_heads * 64 * cfg.head_dim * 2  # one attention block of four, keys in float16
    assert planned.kv_bytes == kv + 3 * 3 * per_slot == stage_cache_nbytes(cfg, 0, 4, 3, 3 * 64 // 16, torch.float32)
    stage = whole(model.path)
    stage.allocate_cache(3, 64)
    stage.cache.reserve(stage.cache.n_pages)  # the pool at its fullest
    assert stage.cache.nbytes == planned.kv_bytes and isinstance(stage.cache.recurrent, RecurrentState)
    assert stage.cache.k.shape[0] == 1 and stage.cache.recurrent.delta.shape[:2] == (3, 3)
    assert isinstance(stage.blocks[2].attn, GatedDeltaNet) and stage.blocks[3].layer == 0


def test_bf16_keeps_the_decay_parameters_in_float32_and_rounds_no_worse_than_transformers():
    transformers = pytest.importorskip("transformers")
    stage = whole(hf_path("qwen35moe"), dtype=torch.bfloat16)
    mixer = stage.blocks[0].attn
    assert mixer.a.dtype == mixer.dt_bias.dtype == torch.float32 and mixer.w_out.weight.dtype == torch.bfloat16
    stage.allocate_cache(1, 64)
    ours = stage(torch.tensor([PROMPT]), [0], [0])[0, -1]
    exact, rounded = (
        transformers.AutoModelForCausalLM.from_pretrained(hf_path("qwen35moe"), dtype=dtype).eval()
        for dtype in (torch.float32, torch.bfloat16)
    )
    with torch.no_grad():
        exact, rounded = (m(torch.tensor([PROMPT])).logits[0, -1].float() for m in (exact, rounded))
    assert float((ours - exact).abs().max()) <= 1.25 * float((rounded - exact).abs().max())


# Bad input


def _hf_copy(tmp_path, name):
    folder = tmp_path / name
    shutil.copytree(hf_path(name), folder)
    return folder


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    cfg, tensors, vocab = model_source("qwen35")
    dropped = {k: v for k, v in tensors.items() if k != "blk.1.ssm_dt.bias"}
    path = write_gguf(tmp_path / "missing.gguf", cfg, dropped, vocab.gguf_metadata)[0]
    with pytest.raises(ModelError, match=r"missing tensor 'blk\.1\.ssm_dt\.bias'"):
        open_model(path)
    bent = dict(tensors, **{"blk.2.ssm_conv1d.weight": tensors["blk.2.ssm_conv1d.weight"][:, :3]})
    path = write_gguf(tmp_path / "bent.gguf", cfg, bent, vocab.gguf_metadata)[0]
    with pytest.raises(ModelError, match=r"'blk\.2\.ssm_conv1d\.weight' has shape \[160, 3\], expected \[160, 4\]"):
        open_model(path)


def _irregular_qwen35():
    """The qwen35 test model with blocks 0 and 3 swapped: full attention in block 0 alone, delta-net
    blocks after it, which no full_attention_interval describes."""
    import dataclasses

    cfg, tensors, vocab = model_source("qwen35")
    swap = {"blk.0.": "blk.3.", "blk.3.": "blk.0."}
    swapped = {swap.get(k[:6], k[:6]) + k[6:]: v for k, v in tensors.items()}
    return dataclasses.replace(cfg, linear_blocks=(1, 2, 3, 4)), swapped, vocab


def test_blocks_listed_per_layer_in_recurrent_layers_are_read_before_the_interval(tmp_path):
    """Today's converter lists each block's kind in attention.recurrent_layers and leaves
    full_attention_interval out (its default of 4 would misread this file): both forms load the
    same model."""
    cfg, tensors, vocab = _irregular_qwen35()
    path = write_gguf(tmp_path / "irregular.gguf", cfg, tensors, vocab.gguf_metadata)[0]
    meta = open_model(path).metadata
    assert meta["qwen35.attention.recurrent_layers"] == [False, True, True, True, True]
    assert "qwen35.full_attention_interval" not in meta
    assert open_model(path).config.linear_blocks == (1, 2, 3, 4)
    from shardwire_kit.writer import write_hf

    folder = write_hf(tmp_path / "irregular-hf", cfg, tensors, tokenizer_json=vocab.tokenizer_json)
    a, b = whole(folder), whole(path)
    ids = torch.tensor([PROMPT])
    for stage in (a, b):
        stage.allocate_cache(1, 64)
    torch.testing.assert_close(a(ids, [0], [0]), b(ids, [0], [0]), rtol=1e-4, atol=1e-4)


def test_metadata_that_contradicts_the_tensors_is_an_error_naming_both(tmp_path):
    cfg, tensors, vocab = _irregular_qwen35()
    original = model_source("qwen35")[0]  # says block 0 is a delta-net and block 3 full attention
    path = write_gguf(tmp_path / "contradicts.gguf", original, tensors, vocab.gguf_metadata)[0]
    said = r"missing tensor 'blk\.0\.attn_qkv\.weight'.*block 0 gated_delta_net.*attn_q\.weight"
    with pytest.raises(ModelError, match=said):
        open_model(path)


def test_unsupported_settings_are_refused(tmp_path):
    folder = _hf_copy(tmp_path, "qwen35")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"layer_types": ["linear_attention"] * 3}))
    with pytest.raises(ConfigError, match="layer_types must list one of"):
        open_model(folder)
    cfg = model_source("qwen35")[0]
    with pytest.raises(ConfigError, match="7 value heads are not a multiple of 2 key heads"):
        config_from_dict({**cfg.to_dict(), "ssm_v_heads": 7})
    with pytest.raises(ConfigError, match="qwen3 has no linear-attention blocks"):
        config_from_dict({**cfg.to_dict(), "arch": "qwen3"})
    with pytest.raises(ConfigError, match="unsupported architecture 'gpt2'"):
        config_from_dict({**cfg.to_dict(), "arch": "gpt2"})


def test_multi_token_prediction_tensors_are_skipped_with_a_message(tmp_path, caplog):
    """Checkpoints with MTP layers load without them (transformers skips them too)."""
    from safetensors.torch import load_file, save_file

    folder = _hf_copy(tmp_path, "qwen35")
    state = load_file(folder / "model.safetensors")
    state["mtp.fc.weight"] = torch.zeros(64, 128)
    state["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="shardwire.formats"):
        model = open_model(folder)
    assert "skipping 2 multi-token-prediction" in caplog.text
    assert not any(n.startswith("mtp") for n in model.tensors)


def test_a_multimodal_checkpoints_language_model_is_read(tmp_path):
    """Qwen3.5 as published: Qwen3_5ForConditionalGeneration, text_config nested, the language
    model under model.language_model, a vision tower shardwire leaves out."""
    from safetensors.torch import load_file, save_file

    folder = _hf_copy(tmp_path, "qwen35")
    state = load_file(folder / "model.safetensors")
    renamed = {k.replace("model.", "model.language_model.", 1): v for k, v in state.items()}
    renamed["model.visual.blocks.0.norm1.weight"] = torch.zeros(8)
    save_file(renamed, str(folder / "model.safetensors"), metadata={"format": "pt"})
    text = json.loads((folder / "config.json").read_text())
    top = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text}
    (folder / "config.json").write_text(json.dumps(top | {"tie_word_embeddings": False}))
    model = open_model(folder)
    assert model.config == open_model(hf_path("qwen35")).config
    assert set(model.tensors) == set(open_model(hf_path("qwen35")).tensors)


# Across workers, and through a lost one


@pytest.mark.slow
@pytest.mark.parametrize("name,form", [("qwen35", "gguf"), ("qwen35moe", "safetensors")])
def test_two_workers_split_inside_a_run_of_delta_net_blocks(worker_pool, tmp_path, name, form):
    path = model_path(name, "F32") if form == "gguf" else hf_path(name)
    workers = worker_pool(2)
    split = [2, 3] if name == "qwen35" else [1, 1]
    got, plan, _ = distributed(path, [w.address for w in workers], tmp_path / "coord", tensor_split=split)
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, plan.stages[-1].end)]
    assert open_model(path).config.linear(1) and open_model(path).config.linear(2)
    assert_same(single_process(path), got)


def test_engine_runs_sequences_side_by_side_as_each_alone():
    """Concurrent sequences share decode steps; each gets the tokens it gets alone."""
    model = open_model(model_path("qwen35moe", "F32"))

    def run(prompts):
        pipeline = LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=3, ctx=128)
        engine = Engine(pipeline, prefill_chunk=5)
        try:
            handles = [engine.submit(Request(p, GREEDY, max_tokens=12, ignore_eos=True)) for p in prompts]
            for h in handles:
                h.result()
            return [h.tokens for h in handles]
        finally:
            engine.close()

    prompts = [PROMPT, PROMPT[:9], PROMPT[3:]]
    together = run(prompts)
    assert together == [run([p])[0] for p in prompts]


@pytest.mark.slow
def test_a_worker_killed_mid_generation_the_sequences_continue_unchanged(tmp_path):
    """The replay rebuilds every delta-net state from position 0 (prefill of the prompt, then the
    decode steps as they first ran): each sequence goes on with its uninterrupted tokens."""
    from recovery import Setup, collect, wait_for_tokens

    path = model_path("qwen35", "F32")
    reference = {
        p: single_process(path, n=30, sampling=GREEDY, prompt=list(p))[0] for p in (tuple(PROMPT), tuple(PROMPT[:9]))
    }
    s = Setup(tmp_path, path)
    try:
        starts = [stage.start for stage in s.cluster.plan.stages]
        assert any(s.model.config.linear(b - 1) and s.model.config.linear(b) for b in starts[1:])
        handles = [s.engine.submit(Request(list(p), GREEDY, max_tokens=30)) for p in reference]
        wait_for_tokens(handles[0], 8)
        s.workers[1].kill()
        assert [collect(h)[0] for h in handles] == list(reference.values())
        event = s.cluster.events[-1]
        assert event["recovered"] and event["replayed_tokens"] > len(PROMPT) + 8
    finally:
        s.close()


def test_a_replay_of_shared_decode_steps_rebuilds_the_state_exactly():
    """In one process: the pipeline breaks at a step, every cache (KV and recurrent state) is
    dropped, and the engine replays; three sequences sharing decode steps end as uninterrupted."""
    from recovery import BreakingPipeline, collect

    model = open_model(model_path("qwen35moe", "F32"))
    stages = [load_stage(model, 0, 2), load_stage(model, 2, model.config.n_layers)]

    def run(break_at=0):
        pipe = BreakingPipeline(stages, break_at)
        engine = Engine(pipe, prefill_chunk=6)
        try:
            handles = [engine.submit(Request(PROMPT, GREEDY, max_tokens=24, ignore_eos=True))]
            assert pipe.entered.wait(10)
            handles += [
                engine.submit(Request(p, GREEDY, max_tokens=24, ignore_eos=True)) for p in (PROMPT[:9], PROMPT[3:])
            ]
            pipe.go.set()
            return [collect(h)[0] for h in handles]
        finally:
            engine.close()

    uninterrupted = run()
    for break_at in (4, 20):
        assert run(break_at) == uninterrupted


@pytest.mark.parametrize("name", ["qwen35", "qwen35moe"])
def test_llama_cpp_reads_our_files_and_predicts_the_same_tokens(name):
    """Where llama.cpp is built (benchmarks/build_llama_cpp.sh): its logits for the F32 file equal
    ours to within its own arithmetic, and it picks the same token at every prompt position. Its
    reading of the file is independent of ours: value-head order, A's sign and the norms' offset
    are checked against it."""
    path = model_path(name, "F32")
    theirs = llama_cpp_logits(path, PROMPT)
    stage = whole(path)
    stage.allocate_cache(1, 128)
    ours = stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0]
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert float((ours - theirs).abs().max()) <= 2e-3 * float(theirs.max() - theirs.min())
