"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE with its shared expert): files as the
converters write them, routing, and experts that run only for the tokens that chose them.
Agreement with transformers is in test_model.py (every family is in its model set), across
workers in test_distributed.py."""

import json

import numpy as np
import pytest
import torch
from gguf import GGUFReader

from shardwire.config import ConfigError, ModelConfig
from shardwire.formats import ModelError, TensorReader, expert_name, open_model
from shardwire.model import Elsewhere, MixtureOfExperts
from shardwire.pipeline.loading import Placement, load_stage
from shardwire.pipeline.plan import PlanDevice, PlanError, make_plan, parse_overrides
from shardwire.weights import ggml_cpu
from shardwire.weights.packed import PackedLinear
from shardwire_kit.synthetic import load_vocab, random_model
from shardwire_kit.writer import write_gguf

from models import PROMPT, hf_path, llama_cpp_logits, model_path, model_source


def logits(stage, ids):
    stage.allocate_cache(1, 128)
    return stage(torch.tensor([ids]), [0], [0], all_logits=True)[0]


def whole(path, **kw):
    model = open_model(path)
    return load_stage(model, 0, model.config.n_layers, **kw)


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe", "qwen2moe"])
def test_gguf_holds_experts_as_llama_cpps_converter_writes_them(name):
    """One 3-D tensor per block and matrix, the router kept float32, the expert keys; read back
    as one matrix per expert, each a slice of the file."""
    cfg, tensors, _ = model_source(name)
    path = model_path(name, "Q8_0")
    stored = {t.name: t for t in GGUFReader(path).tensors}
    arch = "llama" if name == "mixtral" else name
    gate = stored["blk.1.ffn_gate_exps.weight"]
    assert [int(d) for d in gate.shape] == [cfg.dim, cfg.expert_ffn_dim, cfg.n_experts]  # ggml order
    assert gate.tensor_type.name == "Q8_0"
    assert stored["blk.1.ffn_gate_inp.weight"].tensor_type.name == "F32"
    meta = open_model(path).metadata
    assert meta[f"{arch}.expert_count"] == cfg.n_experts
    assert meta[f"{arch}.expert_used_count"] == cfg.n_experts_used
    assert (f"{arch}.expert_feed_forward_length" in meta) == (name != "mixtral")
    assert (f"{arch}.expert_shared_feed_forward_length" in meta) == (name == "qwen2moe")

    model = open_model(path)
    assert (model.config.n_experts, model.config.n_experts_used) == (cfg.n_experts, cfg.n_experts_used)
    assert "blk.1.ffn_gate_exps.weight" not in model.tensors
    reader = TensorReader()
    parts = [reader.read(model.tensors[expert_name(1, "ffn_gate_exps", e)]) for e in range(cfg.n_experts)]
    assert np.array_equal(np.concatenate(parts), np.asarray(gate.data).reshape(-1))


def test_transformers_fused_expert_tensors_read_like_one_matrix_per_expert(tmp_path):
    """transformers 5 holds a block's experts as gate_up_proj [experts, 2 * ffn, dim] and
    down_proj [experts, dim, ffn]; a folder saved from its state dict as it is gives the same model."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    source = hf_path("qwen3moe")
    ref = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    state = {k: v.contiguous() for k, v in ref.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    folder = tmp_path / "fused"
    folder.mkdir()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "tokenizer.json"):
        (folder / f).write_bytes((source / f).read_bytes())
    fused, per_expert = open_model(folder), open_model(source)
    assert set(fused.tensors) == set(per_expert.tensors)
    torch.testing.assert_close(logits(whole(folder), PROMPT), logits(whole(source), PROMPT), rtol=0, atol=0)


def test_a_token_runs_only_the_experts_it_chose():
    """Decode of one token: k experts per block run, the others never; a prompt runs each
    expert at most once per block, on exactly the rows that chose it."""
    stage = whole(model_path("qwen3moe", "F32"))
    cfg = stage.cfg
    calls: list[tuple[int, int, int]] = []  # (block, expert, rows)
    for b, block in enumerate(stage.blocks):
        assert isinstance(block.ffn, MixtureOfExperts)
        for e, expert in enumerate(block.ffn.experts):
            expert.register_forward_hook(lambda m, args, out, b=b, e=e: calls.append((b, e, args[0].shape[0])))
    stage.allocate_cache(1, 128)
    stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)  # every row through the last block too
    per_block = {b: [(e, n) for bb, e, n in calls if bb == b] for b in range(cfg.n_layers)}
    for b, runs in per_block.items():
        experts = [e for e, _ in runs]
        assert len(experts) == len(set(experts))  # one product per expert
        assert sum(n for _, n in runs) == len(PROMPT) * cfg.n_experts_used  # each row in k of them
        assert len(experts) < cfg.n_experts or len(PROMPT) * cfg.n_experts_used >= cfg.n_experts
    calls.clear()
    stage(torch.tensor([[PROMPT[0]]]), [0], [len(PROMPT)])
    assert len(calls) == cfg.n_layers * cfg.n_experts_used
    assert all(n == 1 for _, _, n in calls)


def test_grouped_experts_equal_every_token_on_its_own():
    """The prompt path (rows grouped by expert) and the one-row path give the same outputs."""
    stage = whole(model_path("mixtral", "F32"))
    moe = stage.blocks[0].ffn
    x = torch.randn(1, 9, stage.cfg.dim, generator=torch.Generator().manual_seed(0))
    grouped = moe(x)
    one_by_one = torch.cat([moe(x[:, i : i + 1]) for i in range(x.shape[1])], dim=1)
    torch.testing.assert_close(grouped, one_by_one, rtol=1e-5, atol=1e-5)
    # and both equal the definition: softmax over every expert, top k, renormalized, weighted sum
    flat = x.reshape(-1, stage.cfg.dim)
    probs = torch.softmax(moe.router(flat), dim=-1)
    top, chosen = probs.topk(stage.cfg.n_experts_used)
    top = top / top.sum(-1, keepdim=True)
    every = torch.stack([expert(flat) for expert in moe.experts], dim=1)  # [rows, experts, dim]
    expected = (every.gather(1, chosen[..., None].expand(-1, -1, flat.shape[1])) * top[..., None]).sum(1)
    torch.testing.assert_close(grouped.reshape(-1, stage.cfg.dim), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weights", ["compact", "packed", "fast"])
def test_quantized_experts_stay_in_their_stored_form(weights):
    """Experts take the same --weights policy as dense matrices: packed modules, never
    dequantized as a whole, with the dequantized model's logits."""
    path = model_path("qwen3moe", "Q8_0")
    packed = whole(path, weights=weights)
    moe = packed.blocks[0].ffn
    if moe.grouped is not None:  # ggml runs them, from one buffer per matrix
        assert moe.grouped.down.dtype == torch.uint8 and moe.grouped.stored == ("Q8_0",) * 3
    elif weights != "fast":  # fast may measure dense fastest on this machine
        assert isinstance(moe.experts[3].down, PackedLinear)
    reference = logits(whole(path, weights="dequant"), PROMPT)
    ours = logits(packed, PROMPT)
    spread = float(reference.max() - reference.min())
    assert float((ours - reference).abs().max()) <= 0.02 * spread


@pytest.mark.skipif(not ggml_cpu.repackable("Q4_K", 256, 256), reason="ggml has no repacked Q4_K layout on this CPU")
def test_experts_held_repacked_decode_on_the_repacked_kernels_and_read_prompts_as_stored(tmp_path):
    """Where Q4_K measures fastest repacked, a block's experts are held in ggml's repacked layout
    (one copy, as many bytes as stored), as llama.cpp holds a CPU's experts: a step gives the
    stored experts' result within rounding, and an expert given 8 rows or more is multiplied by
    ggml's tiled products on the repacked layout, to the stored blocks' bits (where this ggml
    reads the layout so; shardwire's build adds it)."""
    vocab = load_vocab("llama-spm")
    cfg, tensors = random_model(
        "qwen3moe", n_layers=2, dim=256, n_heads=4, n_kv_heads=2, head_dim=64, n_experts=8,
        n_experts_used=2, expert_ffn_dim=256, vocab_size=vocab.size, seed=0,
    )  # fmt: skip
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, vocab.gguf_metadata, weight_type="Q4_K")[0]
    stages = {fmt: whole(path, weights="fast", fastest={"Q4_K": fmt}) for fmt in ("ggml", "repacked")}
    stored, repacked = (stages[fmt].blocks[1].ffn.grouped for fmt in ("ggml", "repacked"))
    assert stored.fmt == "ggml" and repacked.fmt == "repacked" and repacked.stored == ("Q4_K",) * 3
    for a, b in zip((stored.gate, stored.up, stored.down), (repacked.gate, repacked.up, repacked.down)):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.uint8  # the same bytes held
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(32, cfg.dim, generator=generator)
    chosen = torch.tensor([[r % 4, 4 + r % 4] for r in range(32)])  # 8 rows for each expert
    weights = torch.rand(32, 2, generator=generator)
    if ggml_cpu.tiled_reads_repacked():
        assert torch.equal(repacked(x, chosen, weights), stored(x, chosen, weights))
    one = stored(x[:1], chosen[:1], weights[:1])
    by_gemv = repacked(x[:1], chosen[:1], weights[:1])
    torch.testing.assert_close(by_gemv, one, rtol=0, atol=1e-5 * float(one.abs().max()))
    out = {}
    for fmt, stage in stages.items():
        stage.allocate_cache(1, 64)
        out[fmt] = stage(torch.tensor([PROMPT]), [0], [0])
    spread = float(out["ggml"].max() - out["ggml"].min())
    assert float((out["repacked"] - out["ggml"]).abs().max()) <= 0.05 * spread


def test_missing_experts_are_named(tmp_path):
    cfg, tensors, vocab = model_source("mixtral")
    tensors = {k: v for k, v in tensors.items() if not k.startswith("blk.2.ffn_up_exps.")}
    path = write_gguf(tmp_path / "m.gguf", cfg, tensors, vocab.gguf_metadata)[0]
    with pytest.raises(ModelError, match=r"missing tensor 'blk\.2\.ffn_up_exps\.0\.weight' \(and 7 more\)"):
        open_model(path)


def test_bad_expert_counts_are_refused(tmp_path):
    cfg, _, _ = model_source("qwen3moe")
    with pytest.raises(ConfigError, match="experts need 1 to 16 used per token"):
        ModelConfig.from_dict({**cfg.to_dict(), "n_experts_used": 17})
    folder = tmp_path / "hf"
    source = hf_path("qwen3moe")
    folder.mkdir()
    for f in source.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    del config["moe_intermediate_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="missing required key 'moe_intermediate_size'"):
        open_model(folder)


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
def test_ggml_runs_a_blocks_chosen_experts_in_one_call_with_the_per_expert_products():
    """GGMLExperts (mul_mat_id over the stored buffers) gives exactly what ggml's product of each
    chosen expert's own matrices gives, for one row and for a prompt's rows; and the dequantized
    experts' result within ggml's 8-bit activations."""
    model = open_model(model_path("qwen3moe", "Q8_0"))
    moe = whole(model.path, weights="fast", fastest={"Q8_0": "ggml"}).blocks[1].ffn
    grouped = moe.grouped
    assert isinstance(grouped, ggml_cpu.GGMLExperts) and grouped.stored == ("Q8_0",) * 3
    dim, f = model.config.dim, model.config.expert_ffn_dim

    def expert(e):
        gate, up, down = (
            ggml_cpu.GGMLLinear(m[e], "Q8_0", k, torch.float32)
            for m, k in ((grouped.gate, dim), (grouped.up, dim), (grouped.down, f))
        )
        return lambda x: down(torch.nn.functional.silu(gate(x)) * up(x))

    generator = torch.Generator().manual_seed(0)
    for rows in (1, 5, 40):
        x = torch.randn(rows, dim, generator=generator)
        chosen, weights = moe.route(x)
        expected = torch.stack(
            [sum(w * expert(int(e))(x[r : r + 1])[0] for e, w in zip(chosen[r], weights[r])) for r in range(rows)]
        )
        torch.testing.assert_close(grouped(x, chosen, weights), expected, rtol=1e-5, atol=1e-5)
    dense = whole(model.path, weights="dequant").blocks[1].ffn
    x = torch.randn(1, 40, dim, generator=generator)
    torch.testing.assert_close(moe(x), dense(x), rtol=0, atol=0.05 * float(dense(x).abs().max()))


# -ot, --override-tensor


def test_override_tensor_keeps_experts_on_another_device_of_the_same_worker():
    """The plan puts the blocks on cpu:0 and what the pattern matches on cpu:1 of the same worker,
    counts those bytes against cpu:1, and shows them; cpu:1 takes no blocks of its own."""
    model = open_model(model_path("qwen3moe", "Q8_0"))
    ggml = {"Q8_0": "ggml"}
    devices = [PlanDevice("w0", "cpu:0", 1 << 40, fastest=ggml), PlanDevice("w0", "cpu:1", 1 << 40, fastest=ggml)]
    plan = make_plan(model, devices, ctx=256, weights="fast", overrides=parse_overrides(["ffn_.*_exps=cpu:1"]))
    (stage,) = plan.stages
    assert (stage.device.name, stage.start, stage.end) == ("cpu:0", 0, model.config.n_layers)
    experts = sum(t.nbytes for n, t in model.tensors.items() if "_exps." in n)
    assert stage.elsewhere == {devices[1]: experts}  # held as stored, for ggml
    assert "-> w0/cpu:1" in plan.table() and "/ffn_.*_exps/" in plan.table()
    whole_plan = make_plan(model, devices[:1], ctx=256, weights="fast")
    assert stage.weight_bytes + experts == whole_plan.stages[0].weight_bytes

    tight = [devices[0], PlanDevice("w0", "cpu:1", experts // 2, fastest=ggml)]
    with pytest.raises(PlanError, match="cpu:1 needs"):
        make_plan(model, tight, ctx=256, weights="fast", overrides=[("_exps", "cpu:1")]).check_fits()
    with pytest.raises(PlanError, match="w0 has no device cuda:0 .it has cpu:0, cpu:1."):
        make_plan(model, devices, ctx=256, overrides=[("_exps", "cuda:0")])
    with pytest.raises(ValueError, match="not REGEX=DEVICE"):
        parse_overrides(["ffn_exps"])
    with pytest.raises(ValueError, match="bad regular expression"):
        parse_overrides(["ffn_(=cpu"])


@pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
def test_matrices_kept_elsewhere_compute_there_and_give_the_same_logits():
    model = open_model(model_path("mixtral", "Q8_0"))
    ggml = {"Q8_0": "ggml"}
    apart = [Placement("ffn_.*_exps", torch.device("cpu"), torch.float32, ggml)]

    def stage(**kw):
        return load_stage(model, 0, model.config.n_layers, dtype=torch.float32, weights="fast", fastest=ggml, **kw)

    moved = stage(overrides=apart)
    held = moved.blocks[0].ffn.grouped
    assert isinstance(held, Elsewhere) and isinstance(held.inner, ggml_cpu.GGMLExperts)
    assert not isinstance(moved.blocks[0].attn.wo, Elsewhere)
    torch.testing.assert_close(logits(moved, PROMPT), logits(stage(), PROMPT), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3moe", "qwen2moe"])
def test_llama_cpp_reads_our_files_and_predicts_the_same_tokens(name):
    """Where llama.cpp is built (benchmarks/build_llama_cpp.sh): its logits for the F32 file equal
    ours to within its own arithmetic, and it picks the same token at every prompt position."""
    path = model_path(name, "F32")
    theirs = llama_cpp_logits(path, PROMPT)
    ours = logits(whole(path), PROMPT)
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))
    assert float((ours - theirs).abs().max()) <= 2e-3 * float(theirs.max() - theirs.min())


def test_the_shared_expert_runs_for_every_token_behind_its_sigmoid_gate():
    """Qwen2-MoE: the chosen experts' sum plus sigmoid(x . gate) times the shared expert."""
    stage = whole(model_path("qwen2moe", "F32"))
    moe = stage.blocks[2].ffn
    assert moe.shared is not None and not moe.renormalize  # Qwen2-MoE keeps the softmax weights as they are
    x = torch.randn(1, 6, stage.cfg.dim, generator=torch.Generator().manual_seed(0))
    flat = x.reshape(-1, stage.cfg.dim)
    expected = moe.routed(flat) + torch.sigmoid(flat @ moe.shared_gate.weight.T) * moe.shared(flat)
    torch.testing.assert_close(moe(x).reshape(-1, stage.cfg.dim), expected)


def test_a_qwen3_moe_folder_as_transformers_5_saves_it_names_its_experts_num_local_experts(tmp_path):
    """transformers 5 saves Qwen3-MoE's expert count under the name its attribute_map aliases
    (num_local_experts, where earlier releases wrote num_experts): read either way, the model is
    transformers' own."""
    transformers = pytest.importorskip("transformers")
    from shardwire_kit.convert import tiny_hf_model

    fields = dict(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=256,
    )
    folder = tiny_hf_model(tmp_path / "qwen3moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", fields)
    saved = json.loads((folder / "config.json").read_text())
    ids = [464, 2068, 7586, 21831, 18045, 625, 262, 16931]
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = reference(torch.tensor([ids])).logits[0]
    for name in ("num_local_experts", "num_experts"):
        config = {k: v for k, v in saved.items() if k not in ("num_local_experts", "num_experts")} | {name: 4}
        (folder / "config.json").write_text(json.dumps(config))
        model = open_model(folder)
        assert (model.config.n_experts, model.config.n_experts_used) == (4, 2)
        torch.testing.assert_close(logits(whole(folder, dtype=torch.float32), ids), theirs, rtol=1e-3, atol=1e-3)
    (folder / "config.json").write_text(json.dumps(saved | {"num_local_experts": 4, "num_experts": 8}))
    with pytest.raises(ConfigError, match="num_experts=8 and num_local_experts=4 name one value"):
        open_model(folder)
