"""DeepSeek-V3 (shardwire/models/deepseek2.py): a tiny random model from transformers' own
DeepseekV3Config (sigmoid scoring, noaux_tc, as the published config says; YaRN with DeepSeek's
temperature), its folder as transformers saves it and the GGUF llama.cpp's own converter writes from
it, against transformers float32 and llama.cpp's logits; in one process and on 2 workers split
inside the run of expert blocks. The cache keeps what llama.cpp's does: one latent and the shared
rotated key part per position and block."""

import dataclasses
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from shardwire.backends import ggml as ggml_backend
from shardwire.backends.ggml import block as ggml_block
from shardwire.backends.ggml import latent as ggml_latent
from shardwire.cli.bench import weight_formats
from shardwire.config import ConfigError
from shardwire.formats import open_model
from shardwire.kvcache import stage_cache_nbytes
from shardwire.models import variant
from shardwire.pipeline.loading import load_stage
from shardwire.pipeline.plan import PlanDevice, PlanError, make_plan, workspace_bytes
from shardwire.weights import ggml_cpu
from shardwire.weights.ggml_cpu import ggml

from models import converted_checkpoint, llama_cpp_logits, transformers_greedy
from parity import BACKENDS, assert_graphs_give_the_modules_outputs, greedy_tokens, our_logits, stage_outputs
from runs import assert_same, distributed, single_process

transformers = pytest.importorskip("transformers")
convert = pytest.importorskip("shardwire_kit.convert")

PROMPT = [464, 2068, 7586, 21831, 18045, 625, 262, 16931, 3290, 13, 632, 373]


def deepseek(form: str) -> Path:
    """The tiny DeepSeek-V3's folder ("hf") or the converter's float32 GGUF of it ("gguf")."""
    return converted_checkpoint("deepseek3", convert.tiny_deepseek3, form)


@lru_cache(maxsize=None)
def reference():
    return transformers_greedy(deepseek("hf"), PROMPT)


@pytest.mark.parametrize("backend", BACKENDS)  # the parity matrix of test_model.py, DeepSeek-V3's row
@pytest.mark.parametrize("form", ["hf", "gguf"])
def test_logits_and_greedy_tokens_match_transformers(form, backend):
    ref_logits, ref_tokens = reference()
    path = deepseek(form)
    ours = our_logits(path, PROMPT, backend)
    spread = float(ref_logits.max() - ref_logits.min())
    # without YaRN's temperature on the scores the logits part by 17% of a row's spread, with the rotated
    # pairs in the wrong order by half of it
    assert float((ours - ref_logits).abs().max()) <= 3e-3 * spread
    assert greedy_tokens(path, PROMPT, 16, backend) == ref_tokens


def test_llama_cpp_computes_the_converters_file_as_shardwire_does():
    theirs = llama_cpp_logits(deepseek("gguf"), PROMPT)
    ours = our_logits(deepseek("gguf"), PROMPT)
    spread = float(theirs.max() - theirs.min())
    assert float((ours - theirs).abs().max()) <= 5e-3 * spread
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_the_gguf_and_the_folder_read_as_one_model():
    gguf, hf = open_model(deepseek("gguf")), open_model(deepseek("hf"))
    cfg = gguf.config
    assert cfg == dataclasses.replace(hf.config, norm_eps=cfg.norm_eps, rope_scaling=cfg.rope_scaling, hf_layout=False)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.head_dim, cfg.rope_dim, cfg.v_head_dim) == (32, 24, 32, 16, 24)
    assert (cfg.expert_gating, cfg.expert_groups, cfg.expert_groups_used, cfg.expert_weights_scale) == (
        "sigmoid", 4, 2, 2.5
    )  # fmt: skip
    assert cfg.rope_scaling["factor"] == hf.config.rope_scaling["factor"] == 4.0
    assert abs(cfg.rope_scaling["mscale_all_dim"] - hf.config.rope_scaling["mscale_all_dim"]) < 1e-6
    # transformers keeps kv_b whole; the converter splits it into k_b and v_b
    assert "blk.1.attn_kv_b.weight" in hf.tensors and "blk.1.attn_k_b.weight" in gguf.tensors
    routing = "sigmoid_biased_top_k_normalized, plain shared expert"
    assert str(variant(cfg, 1)) == f"latent_attention, silu experts ({routing})"


def test_the_cache_keeps_a_latent_and_the_shared_rotated_part_per_position_as_llama_cpp_does():
    """llama.cpp's MLA cache: per position and block, kv_lora_rank + the rotated width in float16
    (its K cache; it keeps no V), 2 x 48 bytes here; uncompressed keys and values would be
    2 x 4 heads x (32 + 24) x 2 bytes."""
    cfg = open_model(deepseek("gguf")).config
    assert cfg.cache_widths == (1, 48, 0)
    per_position = stage_cache_nbytes(cfg, 0, 1, 1, 1, torch.float32) // 16  # a page is 16 positions
    assert per_position == 48 * 2
    stage = load_stage(open_model(deepseek("gguf")), 0, cfg.n_layers)
    stage.allocate_cache(1, 256)
    stage.cache.reserve(4)
    held = stage.cache.k.nbytes + stage.cache.v.nbytes
    assert held == cfg.n_layers * 4 * 16 * 48 * stage.cache.k.element_size() and stage.cache.v.numel() == 0


def test_a_long_context_fits_where_uncompressed_keys_and_values_would_not():
    """8192 positions in a budget the compressed cache fits and keys and values per head would not."""
    model = open_model(deepseek("gguf"))
    cfg = model.config
    compressed = stage_cache_nbytes(cfg, 0, cfg.n_layers, 1, 8192 // 16, torch.float32)
    uncompressed = cfg.n_layers * 8192 * 2 * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim) // 2 * 2
    plan = make_plan(model, [PlanDevice("local", "cpu", 1 << 40)], n_slots=1, ctx=8192)
    (stage_plan,) = plan.stages
    assert stage_plan.kv_bytes == compressed < uncompressed / 4
    # a device with room for the weights, the workspace and the compressed cache, not the uncompressed one
    free = stage_plan.weight_bytes + stage_plan.workspace_bytes + (compressed + uncompressed) // 2
    make_plan(model, [PlanDevice("local", "cpu", free)], n_slots=1, ctx=8192).check_fits()
    short = free - (compressed + uncompressed) // 2 + compressed // 2
    with pytest.raises(PlanError, match="does not fit"):
        make_plan(model, [PlanDevice("local", "cpu", short)], n_slots=1, ctx=8192).check_fits()
    ids = PROMPT * 4
    stage = load_stage(model, 0, cfg.n_layers)
    stage.allocate_cache(1, 8192)
    position = 8192 - len(ids) - 1
    out = stage(torch.tensor([ids]), [0], [position])  # a prompt at the far end of the context
    assert torch.isfinite(out).all()


def test_settings_it_does_not_compute_are_refused(tmp_path):
    import json

    folder = tmp_path / "ds"
    convert.tiny_deepseek3(folder, layers=2)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"topk_method": "group_limited_greedy"}))
    with pytest.raises(ConfigError, match="topk_method 'group_limited_greedy' with scoring_func 'sigmoid'"):
        open_model(folder)
    (folder / "config.json").write_text(json.dumps(config | {"rope_interleave": False}))
    with pytest.raises(ConfigError, match="rope_interleave false"):
        open_model(folder)


def test_ggmls_graphs_take_its_blocks_and_give_what_the_modules_give():
    """Latent attention in the graphs, absorbed as llama.cpp's (the queries through their
    bottleneck and each head's key matrix, the cached latents and shared rotated part, each head's
    value matrix), and the feed-forward halves (the dense one, the experts' sigmoid routing in
    groups beside the shared expert), in a prompt read in two chunks and a stage's one-graph
    decode step, with the cache in float16 as llama.cpp keeps it."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    model = open_model(deepseek("gguf"))
    assert all(ggml_backend.refusal(variant(model.config, i)) is None for i in range(model.config.n_layers))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F32": "ggml"})
    assert all(isinstance(block.runner, ggml_latent.LatentGraphs) for block in stage.blocks)
    assert isinstance(stage.runner, ggml_block.StageGraph)
    assert_graphs_give_the_modules_outputs(stage, (6, 4))


def test_the_plan_counts_the_latent_queries_and_outputs_a_prompt_holds_between_a_blocks_graphs():
    """A prompt's rows hold each head's absorbed query (latent and rotated part) and its latent
    output between a block's graphs on a CPU: 3x and 2x the model's width here, 9x and 8x in the
    DeepSeek-V3 layout, where the plan once counted the model's width for each and fell 7% short of
    a worker's peak. The widths the plan's workspace counts are those buffers'."""
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    import threading

    from shardwire.backends.ggml.graph import scratch_held
    from shardwire.pipeline.plan import workspace_bytes

    model = open_model(deepseek("gguf"))
    cfg = model.config
    stage = load_stage(model, 0, cfg.n_layers, weights="fast", fastest={"F32": "ggml"})
    stage.allocate_cache(1, 64)
    held = {}

    def prompt():  # in a thread of its own: its scratch is this prompt's alone
        stage(torch.tensor([PROMPT]), [0], [0])
        held.update(scratch_held())

    reader = threading.Thread(target=prompt)
    reader.start()
    reader.join()
    queries, outputs = cfg.attention_widths
    assert (queries, outputs) == (cfg.n_heads * 48, cfg.n_heads * 32) and queries + outputs > 4 * cfg.dim
    assert (held["queries"], held["attention"]) == (len(PROMPT) * queries * 4, len(PROMPT) * outputs * 4)
    rows = (2 * cfg.dim + queries + outputs) * len(PROMPT) * 4
    assert workspace_bytes(cfg, len(PROMPT), True, torch.float32, "cpu") >= rows


def _graphs_stage():
    if not ggml_cpu.available():
        pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
    model = open_model(deepseek("gguf"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F32": "ggml"})
    return model.config, stage, [block.runner for block in stage.blocks]


@pytest.mark.parametrize("heads, scores", [(None, None), (5000, 1)])
def test_the_expanded_form_gives_what_the_modules_give_whatever_its_groups(heads, scores, monkeypatch):
    """A prompt's rows in expanded form (each head's keys and values decompressed from the cached
    latents, attention at the heads' widths), read whole and in two chunks: within the bound the
    absorbed form is held to, with the same largest entry in every row. With its memory bounds
    made small, the heads are decompressed two at a time and the rows attend eight at a time."""
    cfg, stage, runners = _graphs_stage()
    if heads is not None:
        monkeypatch.setattr(ggml_latent, "UNPACKED", heads)  # 2 heads' keys and values at 10 positions
        monkeypatch.setattr(ggml_latent, "SCORES", scores)
    for graphs in runners:
        graphs.expands()
        graphs.crossover = ggml_latent.ALWAYS
    for chunks in [(10,), (6, 4)]:
        assert_graphs_give_the_modules_outputs(stage, chunks)
    # the expanded form ran (but in the last block, whose last row alone comes out of a prompt)
    assert all(ggml_latent.UNPACK in graphs._built for graphs in runners[:-1])


def test_a_prompt_runs_in_the_form_measured_faster_here(caplog):
    """The stage's start times both forms (choose_form) and says what it chose; a prompt chunk runs
    expanded where the fitted crossover says so for its rows and the positions it sees, absorbed
    elsewhere; the turned key matrices are held only where the expanded form runs."""
    import logging

    with caplog.at_level(logging.INFO, logger="shardwire.ggml"):
        cfg, stage, runners = _graphs_stage()
    (line,) = [r.getMessage() for r in caplog.records if "latent attention" in r.getMessage()]
    (crossover,) = {graphs.crossover for graphs in runners}
    (chosen,) = stage.choices  # as the worker reports it, for `shardwire bench` to print
    assert chosen in line
    assert chosen.startswith("latent attention: " + ("absorbed" if crossover is None else "prompt chunks expanded"))
    assert all((graphs.k_b_t is not None) == (crossover is not None) for graphs in runners)
    stage.allocate_cache(2, 1024)
    # (slot, first position, rows): a prompt read whole, then a long chunk and a short one after it
    for slot, start, rows in [(0, 0, 16), (1, 0, 300), (1, 300, 40), (0, 16, 200)]:
        for graphs in runners:
            graphs._built.pop(ggml_latent.UNPACK, None)
        stage(torch.tensor([(PROMPT * 64)[start : start + rows]]), [slot], [start])
        expanded = crossover is not None and crossover.expands(rows, start + rows)
        assert all((ggml_latent.UNPACK in graphs._built) == expanded for graphs in runners[:-1]), (rows, line)


def test_value_matrices_stored_q5_0_run_widened_to_q8_0_or_as_stored_with_the_same_outputs(caplog, monkeypatch):
    """Each head's value matrices stored Q5_0 (as llama-quantize leaves DeepSeek-V3's per-head
    matrices in Q4_K_M files): the stage's start times a decode row's products through them as
    stored and widened to Q8_0 (the same values) and says what it chose. Each way forced in turn,
    the block graphs give the same outputs: both multiply the same values by the same rows rounded
    to Q8_0."""
    import logging

    from shardwire.model import dense_weight
    from shardwire.weights.ggml_cpu import GGMLLinear

    cfg, stage, _ = _graphs_stage()
    for block in stage.blocks:
        weight = dense_weight(block.attn.v_b).float()
        raw = ggml_cpu.quantized(weight, "Q5_0")
        block.attn.v_b = GGMLLinear(raw, "Q5_0", weight.shape[1], torch.float32)
    with caplog.at_level(logging.INFO, logger="shardwire.ggml"):
        ggml_backend.attach(stage)
    (chosen,) = [c for c in stage.choices if c.startswith("each head's key and value matrices: Q5_0 ")]
    widened = chosen.endswith("widened to Q8_0")
    for g in (block.runner for block in stage.blocks):
        assert bool(g._widened) == widened and (g.v_b[0].qtype == ggml.GGML_TYPE_Q8_0) == widened
    assert any(chosen in r.getMessage() and "as stored/widened" in r.getMessage() for r in caplog.records)
    outputs = {}
    for way, times in {"as stored": (1.0, 2.0), "widened to Q8_0": (2.0, 1.0)}.items():
        monkeypatch.setattr(ggml_latent, "_per_head_seconds", lambda _, t=times: dict(zip(("stored", "widened"), t)))
        ggml_backend.attach(stage)
        assert any(c.endswith(way) for c in stage.choices)
        assert all((block.runner.v_b[0].qtype == ggml.GGML_TYPE_Q8_0) == (way != "as stored") for block in stage.blocks)
        outputs[way] = stage_outputs(stage, True, (6, 4))
    copies = sum(c.nbytes for block in stage.blocks for c in block.runner._widened)
    assert copies == cfg.n_layers * ggml_latent.widened_bytes(cfg, "F32", "Q5_0") > 0  # as the plan counts them
    for a, b in zip(*outputs.values()):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def _form_seconds(per_row_key, per_key, per_row, per_call):
    return lambda rows, seen: per_row_key * rows * seen + per_key * seen + per_row * rows + per_call


def test_the_crossover_is_where_the_fitted_forms_cross_at_each_context():
    """Fitted to times of the shape each form takes (attention over every key per row, the keys
    decompressed once a chunk, each row's projections, each call's cost), the crossover gives the
    rows from which the expanded form is the faster at each context, more rows the longer the
    context, as the arithmetic of DeepSeek-V3's heads has it (576 + 512 against 192 + 128 values
    per row and key; 2 x 128 x 512 per key decompressed, as many per row projected); never where
    the absorbed form is faster at every size."""
    absorbed, expanded = _form_seconds(1088, 0, 131072, 1e4), _form_seconds(320, 131072, 0, 5e4)
    points = {(r, p + r): (absorbed(r, p + r), expanded(r, p + r)) for p in (512, 2048) for r in (16, 64, 256)}
    crossover = ggml_latent.Crossover.fit(points)
    for seen in (600, 4096, 65536):
        least = crossover.rows_from(seen)
        assert absorbed(least, seen) > expanded(least, seen) and absorbed(least - 1, seen) <= expanded(least - 1, seen)
    assert crossover.rows_from(600) < crossover.rows_from(4096) < crossover.rows_from(65536) <= 171
    assert not crossover.expands(150, 8192) and crossover.expands(150, 600)
    cheap = _form_seconds(320, 100, 0, 5e4)  # decompressing costs next to nothing: from the fewest rows timed
    assert ggml_latent.Crossover.fit({k: (absorbed(*k), cheap(*k)) for k in points}).rows_from(4096) == 16
    slower = _form_seconds(2000, 131072, 0, 5e4)
    never = ggml_latent.Crossover.fit({k: (absorbed(*k), slower(*k)) for k in points})
    assert all(never.rows_from(seen) is None for seen in (600, 4096, 65536))


def test_the_plan_counts_what_the_expanded_form_holds():
    """The plan of a CPU stage counts each block's turned key matrices (as a stage holds them once
    the expanded form is chosen) beside the file's tensors, and a prompt's decompressed keys and
    values in its workspace, as a prompt in expanded form holds them."""
    import threading

    from shardwire.backends.ggml.graph import scratch_held

    cfg, stage, runners = _graphs_stage()
    model = open_model(deepseek("gguf"))
    plan = make_plan(model, [PlanDevice("local", "cpu", 1 << 40)], n_slots=1, ctx=256)
    (planned,) = plan.stages
    files = sum(t.nbytes for t in model.stage_tensors(0, cfg.n_layers, True, True).values())
    for graphs in runners:
        graphs.expands()
        graphs.crossover = ggml_latent.ALWAYS
    turned = sum(graphs.k_b_t.nbytes for graphs in runners)
    assert turned == cfg.n_layers * ggml_latent.turned_key_bytes(cfg, "F32") > 0
    assert planned.weight_bytes == files + turned
    stage.allocate_cache(1, 256)
    held = {}

    def prompt():  # in a thread of its own: its scratch is this prompt's alone
        stage(torch.tensor([(PROMPT * 20)[:200]]), [0], [0])
        held.update(scratch_held())

    reader = threading.Thread(target=prompt)
    reader.start()
    reader.join()
    unpacked = held["expanded keys"] + held["expanded values"]
    assert 0 < unpacked <= ggml_latent.expanded_workspace(cfg, 200, 200) // 2
    assert ggml_latent.expanded_workspace(cfg, 200, 256) <= ggml_latent.expanded_workspace(cfg, 512, 256)
    no_latent = workspace_bytes(cfg, 512, True, torch.float32, "cpu")
    assert planned.workspace_bytes >= no_latent + ggml_latent.expanded_workspace(cfg, 512, 256)


@pytest.mark.slow
def test_two_workers_split_inside_the_expert_blocks_give_the_single_process_tokens(worker_pool, tmp_path):
    path = deepseek("gguf")
    workers = worker_pool(2)
    formats = []
    got, plan, _ = distributed(
        path,
        [w.address for w in workers],
        tmp_path / "coord",
        tensor_split=[1, 1],
        prompt=PROMPT,
        loaded=lambda cluster: formats.extend(weight_formats(None, cluster)),
    )
    assert [(s.start, s.end) for s in plan.stages] == [(0, 2), (2, 4)]
    assert_same(single_process(path, prompt=PROMPT), got)
    if ggml_cpu.available():  # a worker's choice of latent attention's form, as `shardwire bench` prints it
        assert len(formats) == 2 and any("; latent attention: " in line for line in formats), formats
