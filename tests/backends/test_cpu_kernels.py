"""ggml on CPU devices: weights in ggml's repacked layout multiply as their stored blocks do, a dense
block's rows run as ggml graphs (a decode step of a dense stage as one graph) with the results of
the modules they replace, and the compute dtype keeps every weight at its stored precision unless
the user asks otherwise."""

import time

import pytest
import torch

from shardwire import backends
from shardwire.backends.ggml import block as ggml_block
from shardwire.devices import stored_precision_dtype
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.weights import ggml_cpu, measure, policy
from shardwire.weights.pack import pack_matrix
from shardwire.weights.policy import default_dtype

from matrices import matrix
from models import PROMPT, model_path
from parity import assert_graphs_give_the_modules_outputs
from resident import resident_bytes

needs_ggml = pytest.mark.skipif(not ggml_cpu.available(), reason="ggml's kernels are not built here")
needs_repack = pytest.mark.skipif(
    not ggml_cpu.repackable("Q4_0", 512, 64), reason="ggml has no repacked Q4_0 layout on this CPU"
)


@needs_repack
@pytest.mark.parametrize("stored", ["Q4_0", "Q4_K"])
def test_a_repacked_matrix_multiplies_as_its_stored_blocks(stored):
    if not ggml_cpu.repackable(stored, 512, 64):
        pytest.skip(f"ggml has no repacked {stored} layout on this CPU")
    _, raw, ref = matrix(stored, rows=64)
    repacked = pack_matrix(raw, stored, "repacked", "cpu", torch.float32)
    plain = pack_matrix(raw, stored, "ggml", "cpu", torch.float32)
    assert repacked.fmt == "repacked" and plain.fmt == "ggml"
    # the stage counts its bytes (parameters): the stored size, held once
    assert sum(p.nbytes for p in repacked.parameters()) == raw.numel()
    torch.manual_seed(0)
    for x in (torch.randn(1, 512), torch.randn(3, 5, 512), torch.randn(70, 512)):
        y, expected = repacked(x), x @ ref.t()
        assert y.shape == expected.shape
        # ggml quantizes the activations to 8 bits inside its kernels, as llama.cpp does
        assert float((y - expected).abs().max()) <= 1e-2 * float(expected.abs().max())
    one = torch.randn(1, 512)  # one row: the same activation blocks as the stored-block kernel
    assert float((repacked(one) - plain(one)).abs().max()) <= 1e-4 * float(plain(one).abs().max())


needs_tiled_repacked = pytest.mark.skipif(
    not ggml_cpu.tiled_reads_repacked(),
    reason="ggml's tiled products do not read repacked Q4_K here (a ggml without kernels/tiled_q4_Kx8.cpp)",
)


@needs_tiled_repacked
@pytest.mark.parametrize("rows", [256, 264])
def test_a_repacked_q4_k_matrix_reads_prompt_rows_as_its_stored_blocks(rows):
    """From 8 rows of activations ggml's tiled products read the repacked Q4_K layout, each tile
    unpacked into the values the stored blocks give, and from 16 rows (where the CPU has AVX-512
    VNNI) kernels/kquant_gemm.cpp takes both layouts alike: either way the product is the stored
    blocks' bit for bit. Where the driver's tiles would not start on a group of 8 rows (264 rows
    on one thread: tiles of 132), the repacked GEMM takes it; one row goes through the repacked
    GEMV."""
    _, raw, ref = matrix("Q4_K", rows=rows, cols=512)
    repacked = ggml_cpu.RepackedLinear(raw, "Q4_K", 512, torch.float32)
    plain = ggml_cpu.GGMLLinear(raw, "Q4_K", 512, torch.float32)
    random = torch.Generator().manual_seed(0)
    for n in (8, 70):
        x = torch.randn(n, 512, generator=random)
        if rows % 256 == 0:
            assert torch.equal(repacked(x), plain(x))
        else:
            assert float((repacked(x) - x @ ref.t()).abs().max()) <= 1e-2 * float((x @ ref.t()).abs().max())
    one = torch.randn(1, 512, generator=random)
    assert float((repacked(one) - plain(one)).abs().max()) <= 1e-4 * float(plain(one).abs().max())


@needs_tiled_repacked
@pytest.mark.parametrize("own", [True, False], ids=["shardwire-product", "tiled-products"])
def test_a_repacked_q4_k_stage_reads_a_prompt_as_its_stored_blocks_do(own):
    """A stage of repacked Q4_K weights decodes on the repacked kernels and reads a prompt through
    shardwire's Q4_K product (kernels/kquant_gemm.cpp), or with it switched off the tiled products:
    the prompt's logits and the keys and values it caches are the stored-block stage's exactly,
    so the choice of layout changes decode speed and nothing a prompt leaves."""
    if own and "Q4_K" not in ggml_cpu.own_products("gemm"):
        pytest.skip("no Q4_K prompt product of shardwire's in this ggml")
    used = ggml_cpu.own_products_used("gemm")
    ggml_cpu.use_own_products(["Q4_K"] if own else [], "gemm")
    try:
        out, stages = q4_k_prompt_in_both_layouts()
    finally:
        ggml_cpu.use_own_products(used, "gemm")
    assert torch.equal(out["repacked"][0], out["ggml"][0])
    stored, repacked = stages["ggml"].cache, stages["repacked"].cache
    assert torch.equal(stored.k[:, :, :40], repacked.k[:, :, :40])
    assert torch.equal(stored.v[:, :, :40], repacked.v[:, :, :40])
    # decode on other kernels: each product agrees to ~1e-6, but a last bit that moves an
    # activation across an 8-bit rounding step in the next product moves it by a step
    decoded, reference = out["repacked"][1], out["ggml"][1]
    assert float((decoded - reference).abs().max()) <= 0.05 * float(reference.max() - reference.min())


def q4_k_prompt_in_both_layouts():
    """The test Llama in Q4_K held as stored ("ggml") and repacked: each one's (logits of a
    40-token prompt, logits of a decode step after it), and the stages."""
    model = open_model(model_path("llama", "Q4_K"))
    n = model.config.n_layers
    stages = {fmt: load_stage(model, 0, n, weights="fast", fastest={"Q4_K": fmt}) for fmt in ("ggml", "repacked")}
    assert any(isinstance(m, ggml_cpu.RepackedLinear) for m in stages["repacked"].modules())
    assert not any(isinstance(m, ggml_cpu.RepackedLinear) for m in stages["ggml"].modules())
    tokens = torch.tensor([(PROMPT * 4)[:40]])
    out = {}
    for fmt, stage in stages.items():
        assert stage.blocks[0].runner is not None
        stage.allocate_cache(1, 64)
        out[fmt] = stage(tokens, [0], [0], all_logits=True), stage(torch.tensor([[7]]), [0], [40])
    return out, stages


@needs_repack
def test_a_shape_the_repacked_layout_does_not_take_keeps_the_stored_blocks():
    _, raw, _ = matrix("Q4_0", rows=12)  # rows interleave 8 at a time
    module = pack_matrix(raw, "Q4_0", "repacked", "cpu", torch.float32)
    assert module.fmt == "ggml"
    stored = pack_matrix(raw, "Q4_0", "gguf", "cpu", torch.float32)
    assert torch.equal(module.gather(torch.arange(12)), stored.gather(torch.arange(12)))


def test_a_repacked_tied_head_leaves_the_first_stage_a_table_it_can_read():
    model = open_model(model_path("qwen2", "Q4_0"))  # tied embeddings
    assert model.config.tied_embeddings
    tensors = model.stage_tensors(0, model.config.n_layers, True, True)
    fastest = {"Q4_0": "repacked"}
    formats = weight_formats_for(tensors, model, fastest)
    assert formats["token_embd.weight"] == "repacked" and formats[policy.EMBEDDING] == "gguf"
    info = tensors["token_embd.weight"]
    assert policy.format_nbytes("repacked", info.dtype, tuple(info.shape), torch.float32) == info.nbytes


def weight_formats_for(tensors, model, fastest):
    return policy.weight_formats(tensors, True, True, model.config.tied_embeddings, "fast", "cpu", True, fastest)


@needs_repack
def test_the_measurement_times_the_repacked_layout_where_ggml_has_one():
    measured = measure.measure("float32")
    assert "repacked" in measured["Q4_0"]["seconds"]
    assert "repacked" not in measured["F16"]["seconds"]
    assert all(entry["fastest"] in entry["seconds"] for entry in measured.values())


@needs_ggml
@pytest.mark.parametrize(
    "name,stored,fastest",
    [
        ("llama", "F32", {"F32": "dense"}),  # dense weights, Q/K/V and gate/up fused in one matrix each
        ("llama", "F16", {"F16": "ggml"}),
        ("llama", "BF16", {"BF16": "ggml"}),
        ("qwen2", "Q8_0", {"Q8_0": "ggml"}),  # biases on Q, K and V
        ("llama", "Q4_0", {"Q4_0": "repacked"}),
        ("llama3.1", "F32", {"F32": "dense"}),  # RoPE with Llama 3.1's frequency factors
        ("qwen3", "F16", {"F16": "ggml"}),  # a norm on each head's queries and keys
        ("mixtral", "Q8_0", {"Q8_0": "ggml"}),  # experts, their top-k weights renormalized
        ("qwen3moe", "Q4_0", {"Q4_0": "repacked"}),  # experts held repacked
        ("qwen2moe", "F32", {"F32": "ggml"}),  # a shared expert behind its sigmoid gate
    ],
)
def test_block_graphs_give_what_the_modules_give(name, stored, fastest):
    """Every block's rows, and a stage's decode step, in ggml graphs: dense blocks and
    mixture-of-experts ones (routing, the chosen experts and the shared expert in the graph)."""
    model = open_model(model_path(name, stored))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest=fastest, dtype=torch.float32)
    assert all(isinstance(b.runner, ggml_block.BlockGraphs) for b in stage.blocks)
    assert isinstance(stage.runner, ggml_block.StageGraph)
    # ggml quantizes a quantized weight's activations to 8 bits (a BF16 weight's to BF16's 8 bits of
    # mantissa): a last-bit difference between the two computations may round one code the other
    # way, which moves the logits up to ~1e-3 of their scale a block (measured: 3e-3 after 4 blocks
    # of Q4_0 experts on an AVX-512 Xeon; 5e-3 after 2 BF16 blocks with a float16 cache, the EPYC)
    bound = 2e-3 if stored in ("F32", "F16") else 1e-2
    assert_graphs_give_the_modules_outputs(stage, bound=bound)


@needs_ggml
def test_a_dense_stage_decodes_in_one_graph_as_its_blocks_graphs_do():
    """The stage's one graph (RoPE, the cache write, attention and the rest of every block, then the
    final norm and the head) gives the logits and cache entries the blocks' own graphs and the head
    module give, bit for bit, for 3 sequences of different lengths in one step."""
    model = open_model(model_path("qwen2", "Q8_0"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"Q8_0": "ggml"})
    assert isinstance(stage.runner, ggml_block.StageGraph) and stage.runner.logits  # the final norm and head too
    stage.allocate_cache(6, 32)
    lengths = [5, 9, 2]
    for slot, n in enumerate(lengths):
        for copy in (slot, slot + 3):
            stage(torch.tensor([PROMPT[:n]]), [copy], [0])
    step = [[PROMPT[n]] for n in lengths]
    one_graph = stage(step, [0, 1, 2], lengths)
    kept, stage.runner = stage.runner, None
    by_blocks = stage(torch.tensor(step), [3, 4, 5], lengths)
    stage.runner = kept
    assert torch.equal(one_graph, by_blocks)
    k, v = stage.cache.k, stage.cache.v
    for slot, n in enumerate(lengths):
        mine, theirs = slice(32 * slot, 32 * slot + n + 1), slice(32 * (slot + 3), 32 * (slot + 3) + n + 1)
        assert torch.equal(k[:, :, mine], k[:, :, theirs]) and torch.equal(v[:, :, mine], v[:, :, theirs])


@needs_ggml
@pytest.mark.parametrize("stored", ["F16", "Q8_0", "Q4_0"])
def test_a_first_stage_graph_reads_the_token_embedding_as_the_module_does(stored):
    """Token ids go into the stage's one graph, the embedding read by ggml as the table is held:
    the logits and cache of a decode step (one sequence, and two) are the module embedding's."""
    model = open_model(model_path("llama", stored))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={stored: "ggml"})
    assert stage.runner is not None and stage.runner.table is not None
    stage.allocate_cache(4, 32)
    for slot in range(4):
        stage(torch.tensor([PROMPT[:5]]), [slot], [0])
    read = {}
    for ids in ([[PROMPT[5]]], [[PROMPT[5]], [PROMPT[6]]]):
        rows = len(ids)
        read[True] = stage(ids, list(range(rows)), [5] * rows)
        kept, stage.runner = stage.runner, None
        read[False] = stage(torch.tensor(ids), list(range(2, 2 + rows)), [5] * rows)
        stage.runner = kept
        assert torch.equal(read[True], read[False])
        k = stage.cache.k
        assert torch.equal(k[:, :, 5 : 5 + 1], k[:, :, 64 + 5 : 64 + 5 + 1])


@needs_ggml
@pytest.mark.parametrize("graphs", [True, False])
def test_a_sequence_on_scattered_pages_decodes_as_on_consecutive_ones(graphs):
    """Page tables in any order (as a shared prefix or a reused pool leaves them): the same
    logits, and each position's keys and values where its page puts them."""
    model = open_model(model_path("llama", "F16"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F16": "ggml"})
    if not graphs:
        stage.runner = None
        for b in stage.blocks:
            b.runner = None
    stage.allocate_cache(2, 64, n_pages=8)
    prompt = PROMPT + PROMPT[:4]  # 20 positions: two pages a sequence
    layouts = {"consecutive": ([0, 1], [2, 3]), "scattered": ([7, 5], [6, 4])}
    logits = {}
    for name, (a, b) in layouts.items():
        for table in (a, b):
            stage(torch.tensor([prompt]), [0], [0], pages=[table])
        logits[name] = [stage([[PROMPT[4]]], [0], [20], pages=[a])]  # one sequence's step
        logits[name].append(stage([[PROMPT[5]], [PROMPT[6]]], [0, 1], [21, 20], pages=[a, b]))
    for mine, theirs in zip(logits["consecutive"], logits["scattered"]):
        assert torch.equal(mine, theirs)
    k, v = stage.cache.k, stage.cache.v
    for mine, theirs in zip(sum(layouts["consecutive"], []), sum(layouts["scattered"], [])):
        page, other = slice(16 * mine, 16 * mine + 16), slice(16 * theirs, 16 * theirs + 16)
        assert torch.equal(k[:, :, page], k[:, :, other]) and torch.equal(v[:, :, page], v[:, :, other])


@needs_ggml
def test_a_prompt_on_two_threads_gives_what_one_thread_gives():
    """ggml computes RMS_NORM and the MUL after it in one pass on each thread: the graph's layout
    keeps the norm's input where it is until the MUL is done. Placed over it, the MUL's rows on
    one thread overwrote input rows another had not read yet, and a prompt on 2 threads gave
    other logits each time. 16 positions: the F32 products are kernels/' tiles, whose activation
    rows both threads pack into one buffer before either reads them."""
    model = open_model(model_path("qwen3", "F32"))
    logits = []
    for threads in (1, 2, 2):
        torch.set_num_threads(threads)
        try:
            stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F32": "ggml"})
            stage.allocate_cache(1, 64)
            logits.append(stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0])
        finally:
            torch.set_num_threads(1)
    assert all(torch.allclose(other, logits[0], atol=1e-5, rtol=1e-5) for other in logits[1:])


@needs_ggml
def test_a_token_outside_the_vocabulary_is_refused_before_the_graph_runs():
    model = open_model(model_path("llama", "F16"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"F16": "ggml"})
    stage.allocate_cache(1, 32)
    stage([PROMPT[:3]], [0], [0])
    keys = stage.cache.k.clone()
    for bad in (model.config.vocab_size, -1):
        with pytest.raises(ValueError, match="vocabulary"):
            stage([[bad]], [0], [3])
    assert torch.equal(stage.cache.k, keys)


@needs_ggml
def test_blocks_get_graphs_only_on_cpu_in_float32():
    model = open_model(model_path("llama", "Q8_0"))
    stage = load_stage(model, 0, 2, weights="fast", fastest={"Q8_0": "ggml"}, dtype=torch.bfloat16)
    assert all(b.runner is None for b in stage.blocks)


@needs_ggml
def test_a_prompt_piece_stays_below_the_rows_a_matrix_would_rather_take_as_a_gemm():
    """A block whose F32 router (a small matrix) measured faster dequantized into a GEMM from 64
    rows still reads prompts in its graphs, in pieces of fewer rows than that; a matrix that
    would rather take every chunk whole, whatever its rows, sends prompts through the modules."""
    model = open_model(model_path("qwen3moe", "Q8_0"))
    stage = load_stage(model, 0, 1, weights="fast", fastest={"Q8_0": "ggml", "F32": "ggml"})
    block = stage.blocks[0]
    assert isinstance(block.ffn.router, ggml_cpu.GGMLLinear)
    block.ffn.router.gemm_rows = 64
    graphs = ggml_block.BlockGraphs.of(block, stage.inv_freq, model.config.rope_theta)
    assert graphs.piece == 56 and graphs.takes(torch.zeros(1, 200, model.config.dim))
    block.ffn.router.gemm_rows = 1
    assert ggml_block.BlockGraphs.of(block, stage.inv_freq, model.config.rope_theta).piece is None


def test_the_compute_dtype_keeps_weights_at_their_stored_precision():
    assert stored_precision_dtype("bfloat16", "cpu", "F32") == "float32"
    assert stored_precision_dtype("float16", "cuda:0", "F32") == "float32"
    assert stored_precision_dtype("bfloat16", "cpu", "F16") == "float32"
    assert stored_precision_dtype("bfloat16", "cuda:0", "F16") == "float16"
    assert stored_precision_dtype("bfloat16", "cuda:0", "BF16") == "bfloat16"
    assert stored_precision_dtype("bfloat16", "cuda:0", "Q4_K") == "bfloat16"
    if ggml_cpu.available():
        assert default_dtype("cpu") == "float32"  # llama.cpp's CPU backend: float32 activations
    # the type that holds most of a file's matrix bytes (its norms are F32 in every file)
    assert open_model(model_path("llama", "F16")).matrix_type == "F16"
    assert open_model(model_path("llama", "Q4_0")).matrix_type == "Q4_0"


@needs_repack
@pytest.mark.parametrize("piece", [None, 24])
def test_a_prompt_leaves_the_keys_and_values_its_tokens_leave_when_decoded(piece):
    """Where every kernel gives a row the same result whatever rows come with it (ggml's repacked
    Q4_0, and attention one query row at a time), the KV pages a reply filled one token at a time
    are the ones a later prompt holding it computes, in one chunk or in several: a cached reply
    continues a chat exactly as without the cache. (Where a prompt chunk is measured faster as a
    dequantized GEMM, its rows differ from decode's in the last bits.) So too where a chunk's
    positions go through all the blocks a piece at a time (`piece` rows; the default piece of
    these small models is larger than a chunk)."""
    model = open_model(model_path("llama", "Q4_0"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"Q4_0": "repacked"})
    for block in stage.blocks:
        block.runner.piece = piece or block.runner.piece
    n, ctx = 600, 608  # longer than PyTorch's fused attention takes keys in one block
    stage.allocate_cache(3, ctx)
    tokens = torch.tensor([(PROMPT * 40)[:n]])
    whole = stage(tokens, [0], [0], all_logits=True)
    decoded = [stage(tokens[:, :560], [1], [0], all_logits=True)]
    decoded += [stage(tokens[:, t : t + 1], [1], [t], all_logits=True) for t in range(560, n)]
    chunks = [stage(tokens[:, a : a + 512], [2], [a], all_logits=True) for a in (0, 512)]
    assert torch.equal(whole, torch.cat(decoded, dim=1))
    assert torch.equal(whole, torch.cat(chunks, dim=1))
    k, v = stage.cache.k, stage.cache.v
    for slot in (1, 2):
        assert torch.equal(k[:, :, :n], k[:, :, ctx * slot : ctx * slot + n])
        assert torch.equal(v[:, :, :n], v[:, :, ctx * slot : ctx * slot + n])


@needs_repack
@pytest.mark.parametrize("graphs", [True, False])
def test_the_last_block_finishes_only_the_position_the_head_reads(graphs):
    """A prompt's logits are the last position's: the last block computes every position's keys
    and values (later tokens attend to them) but its attention output and feed-forward only for
    that position, as llama.cpp skips the rows it outputs nothing for. The logits and the cache
    are the ones computing every row gives."""
    model = open_model(model_path("llama", "Q4_0"))
    n = model.config.n_layers
    stages = [load_stage(model, 0, n, weights="fast", fastest={"Q4_0": "repacked"}) for _ in range(2)]
    finished = []
    for stage in stages:
        stage.allocate_cache(1, 128)
        for block in stage.blocks:
            block.runner.piece = 16
            if not graphs:
                block.runner = None
        last = stage.blocks[-1]
        last.ffn.register_forward_hook(lambda m, args, out: finished.append(args[0].shape[1]))
        if graphs:
            finish = last.runner.finish
            last.runner.finish = lambda x, attn, gate=None: finished.append(x.shape[1]) or finish(x, attn, gate)
    tokens = torch.tensor([(PROMPT * 10)[:100]])
    every = stages[0](tokens, [0], [0], all_logits=True)
    assert sum(finished) == 100
    finished.clear()
    read = stages[1](tokens, [0], [0])
    assert finished == ([1] * 7 if graphs else [1])  # one row of each 16-row piece, or of the chunk
    if graphs:  # ggml's repacked rows and one-row attention: each row's arithmetic is its own
        assert torch.equal(read, every[:, -1:])
    else:
        torch.testing.assert_close(read, every[:, -1:], rtol=1e-5, atol=1e-5)
    for a, b in ((stages[0].cache.k, stages[1].cache.k), (stages[0].cache.v, stages[1].cache.v)):
        assert torch.equal(a[:, :, :100], b[:, :, :100])


def _chain(g, n: int, steps: int):
    """x -> x * 2 -> + x -> * 2 -> ... (`steps` operations), into "out"."""
    from shardwire.weights.ggml_cpu import ggml

    x = g.fields.data(ggml.ggml_new_tensor_1d(g.ctx, ggml.GGML_TYPE_F32, n), "x")
    y = x
    for i in range(steps):
        y = ggml.ggml_scale(g.ctx, y, 2.0) if i % 2 == 0 else ggml.ggml_add(g.ctx, y, x)
    return g.fields.data(y, "out")


@needs_ggml
def test_graph_intermediates_take_memory_only_while_they_are_read():
    """A chain of operations needs two intermediates' memory whatever its length (each is dead once
    the next has read it); a larger graph built later in the same arena moves the earlier one
    with it; after a prompt's step the arena's pages are given back."""
    import threading

    from shardwire.backends.ggml import graph as ggml_graph

    n = 1 << 16
    x = torch.randn(n)
    result = {}

    def run():
        graphs = {}
        for steps in (6, 2):  # the longer chain first: the arena fits both
            graphs[steps] = ggml_graph.Graph(lambda g: _chain(g, n, steps), ["x", "out"], ggml_graph.PROMPT, 64, 1)
        wider = ggml_graph.Graph(lambda g: _chain(g, 2 * n, 3), ["x", "out"], ggml_graph.PROMPT, 64, 1)
        x2 = torch.cat([x, x])
        for steps, graph in [*graphs.items(), (3, wider)]:
            src = x2 if graph is wider else x
            out = torch.empty_like(src)
            graph([src.data_ptr(), out.data_ptr()])
            result[steps] = out
        result["arenas"] = [graph.arena for graph in [*graphs.values(), wider]]
        arena = wider.arena
        result["resident before"] = resident_bytes(arena.memory.ctypes.data, arena.nbytes)
        ggml_graph.release_graph_memory()
        result["resident after"] = resident_bytes(arena.memory.ctypes.data, arena.nbytes)

    thread = threading.Thread(target=run)  # a thread's own arenas
    thread.start()
    thread.join()
    expect = x.clone()
    for i in range(6):
        expect = expect * 2 if i % 2 == 0 else expect + x
        if i + 1 in (2, 6):
            assert torch.allclose(result[i + 1], expect)
    assert torch.allclose(result[3], torch.cat([x * 2 + x, x * 2 + x]) * 2)
    first, second, wider = result["arenas"]
    assert first is second is wider  # one arena, moved to the larger size with its graphs
    assert wider.nbytes == 2 * (2 * n * 4)  # two intermediates of the wider chain
    assert result["resident before"] == wider.nbytes and result["resident after"] == 0


@needs_repack
def test_a_local_engine_keeps_its_scratch_between_steps_and_gives_it_back_when_idle():
    """The graphs' intermediates stay resident while requests run (the next prompt writes the same
    pages without the OS mapping and zeroing them again) and go back IDLE_S after the last step."""
    from shardwire.engine import Engine, Request
    from shardwire.pipeline import LocalPipeline
    from shardwire.sampling import GREEDY

    model = open_model(model_path("llama", "Q4_0"))
    stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest={"Q4_0": "repacked"})
    engine = Engine(LocalPipeline([stage], n_slots=1, ctx=64), None)
    try:
        for _ in range(2):
            engine.submit(Request(PROMPT[:12], GREEDY, max_tokens=3, ignore_eos=True)).result()
            arenas = {g.arena for b in stage.blocks for kept in b.runner._built.values() for g in kept.values()}
            arenas |= {g.arena for g in stage.runner._built.values()}  # the decode steps'
            assert arenas and all(resident_bytes(a.memory.ctypes.data, a.nbytes) > 0 for a in arenas)
            time.sleep(backends.IDLE_S + 0.5)
            assert all(resident_bytes(a.memory.ctypes.data, a.nbytes) == 0 for a in arenas)
    finally:
        engine.close()


@needs_repack
def test_a_prompt_chunks_blocks_write_their_queries_and_attention_into_the_same_pages():
    """Each block of a prompt chunk takes the thread's scratch for what passes between its graphs
    (not fresh allocations, which the OS maps and zeroes page by page each time); it stays
    resident for the next chunk, until release_scratch (which an idle thread calls)."""
    from shardwire.backends.ggml import graph as ggml_graph

    model = open_model(model_path("llama", "Q4_0"))
    stage = load_stage(model, 0, model.config.n_layers - 1, weights="fast", fastest={"Q4_0": "repacked"})
    stage.allocate_cache(2, 128)
    seen = {}
    for block in stage.blocks:
        store = block.runner.store

        def noted(x, *args, store=store):
            queries, gate = store(x, *args)
            seen.setdefault("queries", set()).add(queries.data_ptr())
            return queries, gate

        block.runner.store = noted
    tokens = torch.tensor([PROMPT[:12]])
    hidden = stage(tokens, [0], [0])
    kept = hidden.clone()
    assert len(seen["queries"]) == 1 and len(stage.blocks) > 1  # one buffer for every block
    stage(torch.tensor([PROMPT[12:24]]), [1], [0])
    assert torch.equal(hidden, kept)  # the stage's output is its own, not the next chunk's scratch
    buffers = ggml_graph._local.scratch  # this thread's, other tests' among them
    assert {"queries", "attention"} <= buffers.keys()
    assert all(
        resident_bytes(buffers[name].memory.ctypes.data, buffers[name].nbytes) > 0 for name in ("queries", "attention")
    )
    backends.release_scratch()
    for buffer in buffers.values():
        assert resident_bytes(buffer.memory.ctypes.data, buffer.nbytes) == 0
    a = ggml_graph.scratch("attention", 2, 8)
    assert a.data_ptr() == ggml_graph.scratch("attention", 1, 16).data_ptr()  # no larger: the same
    assert ggml_graph.scratch("attention", 1 << 12, 1 << 12).data_ptr() != a.data_ptr()  # a larger one


@needs_repack
def test_a_prompt_in_pieces_leaves_a_later_stage_its_input():
    """A stage that is not the first writes a chunk's results beside its input, which the caller
    may still hold; the first writes them over the embeddings it made."""
    model = open_model(model_path("llama", "Q4_0"))
    n = model.config.n_layers
    first = load_stage(model, 0, 1, weights="fast", fastest={"Q4_0": "repacked"})
    later = load_stage(model, 1, n, weights="fast", fastest={"Q4_0": "repacked"})
    for stage in (first, later):
        stage.allocate_cache(1, 128)
        for block in stage.blocks:
            block.runner.piece = 16
    tokens = torch.tensor([(PROMPT * 10)[:100]])
    hidden = first(tokens, [0], [0])
    kept = hidden.clone()
    logits = later(hidden, [0], [0], all_logits=True)
    assert torch.equal(hidden, kept)
    whole = load_stage(model, 0, n, weights="fast", fastest={"Q4_0": "repacked"})
    whole.allocate_cache(1, 128)
    for block in whole.blocks:
        block.runner.piece = 16
    assert torch.equal(logits, whole(tokens, [0], [0], all_logits=True))


@needs_repack
def test_an_experts_rows_read_together_give_what_each_row_alone_gives():
    """Experts held repacked: rows that chose the same expert go through it four at a time (the
    repacked GEMM, where shardwire built ggml) and a row alone through the one-row GEMV, to the
    same bits for Q4_0, as its dense matrices' do."""
    E, D, F = 4, 256, 128
    held = []
    for K, N in ((D, F), (D, F), (F, D)):
        m = ggml_cpu.repacked_experts("Q4_0", K, N, E)
        for e in range(E):
            m.write_expert(e, matrix("Q4_0", rows=N, cols=K, seed=e)[1].numpy())
        held.append(m)
    experts = ggml_cpu.GGMLExperts(*held, ("Q4_0",) * 3)
    random = torch.Generator().manual_seed(0)
    x = torch.randn(11, D, generator=random)
    chosen = torch.tensor([[0, 1]] * 6 + [[1, 2]] * 5)  # expert 1: 11 rows, 0: 6, 2: 5
    weights = torch.rand(11, 2, generator=random)
    together = experts(x, chosen, weights)
    alone = torch.cat([experts(x[i : i + 1], chosen[i : i + 1], weights[i : i + 1]) for i in range(11)])
    assert torch.equal(together, alone)
