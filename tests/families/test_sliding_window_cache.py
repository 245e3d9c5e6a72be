"""The blocks on a sliding window (gpt-oss, Gemma 3) keep their keys and values in a ring per slot
(kvcache.WindowCache), a window and a step's worth of positions, as llama.cpp's sliding-window
cache does: the same logits as keeping every position while the ring wraps many times over, on
the modules and on ggml's graphs; what the ring no longer holds is refused; the plan counts what
is held; a prompt prefix is reused only in the slot whose rings still hold what came before it
(--swa-full keeps every position, and reuses any cached prefix)."""

import pytest
import torch
from test_gemma3 import gemma3
from test_gpt_oss import gpt_oss

from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.kvcache import WindowCache, stage_cache_nbytes
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY

from parity import float32_stage

STEP = 5  # the most positions a step brings: the tiny models' 4-key window and 5 make a 16-position ring
PROMPT = [(37 * i + 11) % 1000 for i in range(40)]


def run(stage, window_step: int) -> list[torch.Tensor]:
    """Logits of: a 40-token prompt in slot 0 at once (its windows' keys in pieces of the ring's
    step), another in slot 1 in chunks of 7, 12 decode steps of both, a step checking 3 positions
    and one going back 2 of them."""
    stage.allocate_cache(2, 128, window_step=window_step)
    out = [stage(torch.tensor([PROMPT]), [0], [0], all_logits=True)[0]]
    for a in range(0, 20, 7):
        out.append(stage(torch.tensor([PROMPT[a : min(a + 7, 20)]]), [1], [a])[0])
    tokens, at = [[int(out[0][-1].argmax())], [int(out[-1][-1].argmax())]], [40, 20]
    for _ in range(12):
        logits = stage(torch.tensor(tokens), [0, 1], at)
        out.append(logits[:, -1])
        tokens, at = [[int(t)] for t in logits[:, -1].argmax(-1)], [p + 1 for p in at]
    checked = stage(torch.tensor([[tokens[0][0], 5, 6]]), [0], [at[0]], all_logits=True)[0]
    again = stage(torch.tensor([[6, 7, 8]]), [0], [at[0] + 1], all_logits=True)[0]
    return out + [checked, again]


@pytest.mark.parametrize("family,backend", [("gpt-oss", "reference"), ("gpt-oss", "ggml"), ("gemma3", "reference")])
def test_a_ring_per_slot_gives_the_logits_of_keeping_every_position(family, backend):
    path = gpt_oss("gguf") if family == "gpt-oss" else gemma3("gguf")
    stage = float32_stage(path, backend)
    assert (stage.runner is not None) == (backend == "ggml")  # a decode step of gpt-oss: one graph
    whole = run(stage, 0)
    assert not isinstance(stage.cache.window, WindowCache)
    assert stage.cache.window.k.shape[2] == 256  # slot 1's pages start at 128; the pool grows by doubling
    ringed = run(stage, STEP)
    window = stage.cache.window
    assert isinstance(window, WindowCache) and (window.size, window.step) == (16, 13)
    assert window.k.shape[2] == 2 * 16
    for a, b in zip(ringed, whole):
        spread = float(b.max() - b.min())
        assert float((a - b).abs().max()) <= 1e-5 * spread
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def test_a_step_the_ring_no_longer_holds_is_refused_and_the_slot_goes_on():
    stage = float32_stage(gpt_oss("gguf"), "reference")
    stage.allocate_cache(2, 128, window_step=STEP)
    stage(torch.tensor([PROMPT]), [0], [0])
    with pytest.raises(ValueError, match=r"slot 0: .* needs those from 17: .*--swa-full"):
        stage(torch.tensor([[1]]), [0], [20])  # positions 17-19 were written over by 33-35
    with pytest.raises(ValueError, match="slot 1: .* holds positions \\[0, 0\\)"):
        stage(torch.tensor([[1]]), [1], [3])  # nothing of slot 1's sequence was written
    with pytest.raises(ValueError, match="slot 0: .* a step over \\[40, 54\\)"):
        stage.cache.window.addresses([0], [40], 14, 54, "cpu")  # more than a step: forward() cuts such in pieces
    # the refusals wrote nothing: the sequence goes on as if they were never asked
    again = stage(torch.tensor([[PROMPT[-1]]]), [0], [39])
    stage.allocate_cache(2, 128)
    stage(torch.tensor([PROMPT]), [0], [0])
    kept = stage(torch.tensor([[PROMPT[-1]]]), [0], [39])
    assert float((again - kept).abs().max()) <= 1e-5 * float(kept.max() - kept.min())


def test_the_plan_counts_the_rings_as_the_stage_holds_them():
    model = open_model(gpt_oss("gguf"))
    cfg = model.config
    stage = load_stage(model, 0, cfg.n_layers)
    for step in (0, STEP, 64):
        stage.allocate_cache(3, 1024, window_step=step)
        for cache in (stage.cache, stage.cache.window):
            cache.reserve(cache.n_pages)  # the pools at their most, as the plan counts them
        planned = stage_cache_nbytes(cfg, 0, cfg.n_layers, 3, 3 * 1024 // 16, stage.dtype, step)
        assert stage.cache.nbytes == planned
    full = stage_cache_nbytes(cfg, 0, cfg.n_layers, 3, 3 * 1024 // 16, stage.dtype)
    ringed = stage_cache_nbytes(cfg, 0, cfg.n_layers, 3, 3 * 1024 // 16, stage.dtype, 512)
    per_block = full // cfg.n_layers  # both kinds hold as much a position
    assert ringed == per_block * 2 + per_block * 2 * 3 * 528 // (3 * 1024)  # 2 full blocks, 2 rings of 528


def replies(window_step: int) -> tuple[list[list[int]], int]:
    """Two requests with the same 40-token prompt, one after the other: their tokens, and the
    prompt positions the second found cached."""
    model = open_model(gpt_oss("gguf"))
    stage = load_stage(model, 0, model.config.n_layers)
    engine = Engine(LocalPipeline([stage], n_slots=1, ctx=128, window_step=window_step), prefill_chunk=STEP)
    try:
        out = []
        for _ in range(2):
            handle = engine.submit(Request(PROMPT, GREEDY, max_tokens=24))
            handle.result()
            out.append(handle.tokens)
        return out, engine.pages.hits
    finally:
        engine.close()


def test_rings_too_small_for_what_a_slot_may_have_written_past_its_tokens_reuse_no_prefix_keeping_all_does():
    """13 positions of slack are fewer than a step's refused proposals may have written."""
    ringed, hits = replies(STEP)
    assert hits == 0
    kept, kept_hits = replies(0)
    assert kept_hits >= 32  # the prompt's full pages before its last token's
    assert ringed[0] == ringed[1] == kept[0] == kept[1]


def chat(window_step: int) -> list[tuple[list[int], int]]:
    """Three requests on 2 slots, one after another: a 200-token prompt, another prompt, then the
    first one's next turn (its prompt, its reply and 10 tokens more): each one's tokens and the
    prompt positions it found cached."""
    model = open_model(gpt_oss("gguf"))
    stage = load_stage(model, 0, model.config.n_layers)
    engine = Engine(LocalPipeline([stage], n_slots=2, ctx=512, window_step=window_step), prefill_chunk=128)
    first = [(37 * i + 11) % 1000 for i in range(200)]
    try:
        out = []
        for prompt in (first, [(53 * i + 7) % 1000 for i in range(100)], None):
            prompt = prompt or first + out[0][0] + list(range(300, 310))
            handle = engine.submit(Request(prompt, GREEDY, max_tokens=24))
            handle.result()
            out.append((handle.tokens, handle.stats.cached_tokens))
        return out
    finally:
        engine.close()


def test_a_chats_next_turn_goes_to_its_slot_and_reuses_the_prefix_its_rings_still_hold():
    """The other prompt goes to the slot nobody used, so the first turn's rings are still there
    for the next turn: rings of 144 positions, which the first turn's 223 went round."""
    ringed, kept = chat(128), chat(0)
    assert [tokens for tokens, _ in ringed] == [tokens for tokens, _ in kept]
    assert [cached for _, cached in ringed] == [0, 0, 208]  # the full pages before the reply's last token
    assert [cached for _, cached in kept] == [0, 0, 208]
