"""Speculative decoding on a real model: a tiny Llama taught to answer its prompt with a passage
of that prompt, so that prompt lookup's proposals are what it writes. With and without
speculation, in one process and over two worker processes, the tokens are the same, greedy and
seeded; with it, fewer steps carry them."""

from __future__ import annotations

import random
from contextlib import contextmanager

import pytest

from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request, core
from shardwire.engine.draft_model import DraftModel, check_vocabularies
from shardwire.engine.drafting import PRIOR_WEIGHT, Acceptance, Drafter, Lookup, Speculation, StepCosts
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY, SamplingParams
from shardwire.tokenizer import load_tokenizer
from shardwire_kit.drafting import Scripted

from speculating import FreeWidth
from workers import WorkerProcess

pytest.importorskip("transformers")

PROMPT = random.Random(7).sample(range(300, 20000), 40)
REPLY = PROMPT[12:30]  # a passage of the prompt
SEEDED = SamplingParams(temperature=0.9, seed=11)


# -- proposals and their length ---------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_earlier_occurrence_of_the_longest_ngram():
    drafter = Lookup(Speculation(ngram=3))
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    assert drafter.lookup(tokens, 4) == [7, 8, 5, 2]  # 2, 3 last seen at 5, 6 (3 at 2 and 6 alike)
    assert drafter.lookup(tokens + [7], 2) == [8, 5]  # 2, 3, 7: the trigram
    assert drafter.lookup([4, 5, 6], 3) == []
    assert drafter.lookup(tokens + [6, 6], 3) == []  # 6, 6 never came before (and single tokens are not looked up)


def test_a_lookup_past_the_known_tokens_leaves_them_out_of_its_index():
    """A step sent ahead looks up after tokens the sequence may yet take back: they are looked up
    from, never indexed, so a later lookup on what the sequence did write finds only its own."""
    drafter = Lookup(Speculation(ngram=2))
    tokens = [1, 2, 3, 4, 5, 6]
    assert drafter.lookup(tokens + [7, 8, 1, 2], 3, known=len(tokens)) == [3, 4, 5]
    written = tokens + [7, 9, 7, 8]  # 7, 8 at 6 and 7 was assumed, never written: not indexed
    assert drafter.lookup(written, 3) == []
    assert drafter.lookup(written + [4, 7, 8], 3) == [4, 7, 8]  # once written, it is
    assert drafter.propose(tokens + [1, 2], FreeWidth(), 8, known=len(tokens), guess=1)[0] == 3


def test_serve_and_generate_send_steps_ahead_unless_told_not_to():
    from shardwire.cli.main import build_parser

    parser = build_parser()
    assert parser.parse_args(["serve", "m.gguf"]).spec_ahead
    assert not parser.parse_args(["generate", "m.gguf", "-p", "x", "--no-spec-ahead"]).spec_ahead


def test_step_costs_between_and_past_the_widths_measured():
    costs = StepCosts()
    assert costs.of(1) is None
    for width, seconds in [(1, 1.0), (1, 1.0), (5, 3.0), (5, 3.0)]:  # each width's first step is not counted
        costs.add(width, seconds)
    assert costs.of(1) == 1.0 and costs.of(5) == 3.0
    assert costs.of(3) == pytest.approx(2.0)
    assert costs.of(9) == pytest.approx(5.0)  # on the line through the two widest


def test_the_length_pays_for_its_step_and_falls_to_none_where_proposals_are_refused():
    """Steps are 1, 2, 4, 8 ... tokens wide (a few widths, each with its graphs built and its cost
    measured): k proposals are 1, 3, 7 ..."""
    costs = StepCosts()
    drafter = Drafter(Speculation(n_max=16))
    assert drafter.length(10, costs, room=100) == 1  # nothing measured: the narrowest proposal
    for width, seconds in [(1, 1.0), (1, 1.0), (2, 1.05), (2, 1.05)]:  # wide steps cost little (a slow link)
        costs.add(width, seconds)
    assert drafter.length(10, costs, room=100) == 3  # 4 wide: tried once 2 is measured, not 8 yet
    for width, seconds in [(4, 1.1), (4, 1.1), (8, 1.2), (8, 1.2)]:
        costs.add(width, seconds)
    assert drafter.length(10, costs, room=100) == 3  # at a rate of one half (before any is checked)
    for _ in range(10):
        drafter.checked(7, 7)
    assert drafter.length(10, costs, room=100) == 7
    assert drafter.length(10, costs, room=5) == 3
    for _ in range(200):
        drafter.checked(7, 0)
    assert drafter.length(10, costs, room=100) == 0
    dear = StepCosts()
    for width, seconds in [(1, 1.0), (1, 1.0), (2, 2.0), (2, 2.0)]:  # a proposal costs a whole step
        dear.add(width, seconds)
    assert [Drafter(Speculation()).length(4, dear, room=100) for _ in range(40)] == [0] * 40  # and is never probed


def test_a_new_sequence_starts_from_the_rate_the_engine_has_seen():
    seen = Acceptance()
    assert Drafter(Speculation(), seen).acceptance.rate == 0.5  # nothing seen yet
    for _ in range(30):
        seen.checked(4, 0)
    fresh = Drafter(Speculation(), seen)
    assert fresh.acceptance.rate < 0.05 and fresh.acceptance.kept + fresh.acceptance.refused == PRIOR_WEIGHT
    for _ in range(3):  # its own steps soon outweigh where it started
        fresh.checked(4, 4)
    assert fresh.acceptance.rate > 0.8


# -- a real model ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def copier(tmp_path_factory):
    from shardwire_kit.convert import teach, tiny_hf_model

    config = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    folder = tiny_hf_model(tmp_path_factory.mktemp("copier") / "hf", "LlamaConfig", "LlamaForCausalLM", config)
    return teach(folder, PROMPT, REPLY)


def generate(pipeline, sampling, speculation=None, n=len(REPLY) + 6, draft=None, ahead=True):
    """The tokens, the request's stats and the engine's counters."""
    engine = Engine(pipeline, draft=draft, ahead=ahead)
    engine.step_costs = FreeWidth()
    try:
        handle = engine.submit(Request(PROMPT, sampling, max_tokens=n, ignore_eos=True, speculation=speculation))
        handle.result()
        assert handle.error is None, handle.error
        return handle.tokens, handle.stats, engine.counters
    finally:
        engine.close()


def one_process(folder):
    model = open_model(folder)
    return LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=1, ctx=128)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_in_one_process_speculation_gives_the_same_tokens_in_fewer_steps(copier, sampling):
    plain, _, plain_counters = generate(one_process(copier), sampling)
    assert plain[: len(REPLY)] == REPLY or sampling is SEEDED
    tokens, stats, counters = generate(one_process(copier), sampling, Speculation(n_max=8))
    assert tokens == plain
    assert stats.draft_n_accepted >= len(REPLY) // 2, (stats.draft_n, stats.draft_n_accepted)
    assert counters.decode_steps < plain_counters.decode_steps - len(REPLY) // 2
    assert counters.ahead_steps == 0  # one process: its stages run one after another


@contextmanager
def on_two_workers(path, tmp_path):
    """The model over two worker processes, half its blocks on each."""
    workers = [WorkerProcess(tmp_path / f"cache{i}").start() for i in range(2)]
    try:
        cluster = Cluster([w.address for w in workers], cache_dir=tmp_path / "coordinator", show_progress=False)
        try:
            cluster.connect(open_model(path))
            yield cluster.load(cluster.make_plan(tensor_split=[1, 1], ctx=128, dtype="float32"))
        finally:
            cluster.close()
    finally:
        for w in workers:
            w.stop()


def test_a_next_turn_reuses_the_pages_a_speculating_reply_wrote(copier):
    """The positions a step wrote past the proposals it kept are written over by the next step,
    and the last token's is never counted: the full pages of a speculating sequence, its reply
    included, are a prefix the next turn reuses, and that turn's tokens are those a fresh
    engine writes without the cache or speculation."""
    engine = Engine(one_process(copier))
    engine.step_costs = FreeWidth()
    try:
        first = engine.submit(Request(PROMPT, GREEDY, max_tokens=len(REPLY), speculation=Speculation(n_max=8)))
        first.result()
        assert first.stats.draft_n_accepted >= len(REPLY) // 2
        turn = PROMPT + first.tokens + PROMPT[:6]
        second = engine.submit(Request(turn, GREEDY, max_tokens=12, ignore_eos=True, speculation=Speculation(n_max=8)))
        second.result()
        assert second.error is None and second.stats.cached_tokens >= len(PROMPT)
    finally:
        engine.close()
    fresh = Engine(one_process(copier))
    try:
        plain = fresh.submit(Request(turn, GREEDY, max_tokens=12, ignore_eos=True, cache_prompt=False))
        plain.result()
        assert second.tokens == plain.tokens
    finally:
        fresh.close()


def draft_model(folder, n_slots=1, ctx=128) -> DraftModel:
    model = open_model(folder)
    return DraftModel(load_stage(model, 0, model.config.n_layers), n_slots, ctx)


@pytest.fixture(scope="module")
def smaller(tmp_path_factory):
    """A 2-block model of the copier's vocabulary that was never taught its reply."""
    from shardwire_kit.convert import tiny_hf_model

    config = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    return tiny_hf_model(tmp_path_factory.mktemp("smaller") / "hf", "LlamaConfig", "LlamaForCausalLM", config, seed=5)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_models_proposals_give_the_tokens_of_plain_decoding(copier, smaller, sampling):
    """The copier drafting for itself proposes what it writes; a smaller untaught model of its
    vocabulary proposes other tokens, refused: either way the tokens are plain decoding's."""
    plain, _, plain_counters = generate(one_process(copier), sampling)
    spec = Speculation("draft-simple", n_max=8)
    tokens, stats, counters = generate(one_process(copier), sampling, spec, draft=draft_model(copier))
    assert tokens == plain and stats.draft_n_accepted >= len(REPLY) // 2
    assert counters.decode_steps < plain_counters.decode_steps
    tokens, stats, _ = generate(one_process(copier), sampling, spec, draft=draft_model(smaller))
    assert tokens == plain and stats.draft_n > stats.draft_n_accepted


def _family_file(family: str):
    from shardwire_kit import convert

    from models import converted_checkpoint, model_path

    if family in ("llama", "qwen3moe", "qwen35"):
        return model_path(family, "F32" if family == "llama" else "Q8_0")
    make = {
        "gemma3": convert.tiny_gemma3,
        "deepseek2": convert.tiny_deepseek3,
        "glm4moe": convert.tiny_glm4moe,
        "gpt-oss": convert.tiny_gpt_oss,
    }
    # the names other tests build these under with the same defaults (their gemma3 has 7 blocks)
    return converted_checkpoint("gemma3-6" if family == "gemma3" else family, make[family], "hf")


@pytest.mark.parametrize("family", ["llama", "qwen3moe", "gemma3", "deepseek2", "glm4moe", "gpt-oss", "qwen35"])
def test_every_family_checks_proposals_in_one_step_as_it_decodes_them(family):
    """The model drafting for itself: each step carries proposals it keeps (its own greedy tokens),
    the positions through its blocks' decode graphs as rows of one position (sliding windows,
    attention sinks, latent attention, experts; a hybrid's delta-net state keeps a copy from
    before each step's proposals), and the tokens are plain decoding's."""
    path = _family_file(family)
    prompt = PROMPT[:12]

    def run(speculation=None, draft=None):
        engine = Engine(one_process(path), draft=draft)
        engine.step_costs = FreeWidth()
        try:
            handle = engine.submit(Request(prompt, GREEDY, max_tokens=24, ignore_eos=True, speculation=speculation))
            handle.result()
            assert handle.error is None, handle.error
            return handle.tokens, handle.stats
        finally:
            engine.close()

    plain, _ = run()
    tokens, stats = run(Speculation("draft-simple", n_max=7), draft_model(path))
    assert tokens == plain
    assert stats.draft_n_accepted >= 12, (stats.draft_n, stats.draft_n_accepted)


def scripted(engine: Engine, written: list[int], n_prompt: int) -> Engine:
    engine.step_costs = FreeWidth()
    engine.acceptance["ngram-simple"] = Acceptance()
    engine._drafter = lambda speculation, slot: Scripted(written, n_prompt, engine.pipeline.vocab_size)
    return engine


def test_a_hybrid_takes_back_the_proposals_it_refuses(tmp_path):
    """Qwen3.5's delta-net state folds in every position fed, refused proposals too: each stage
    keeps a copy from before a step's proposals and, where the next step starts inside them,
    goes back to it and feeds the kept positions again. Every step refuses some proposals (and
    some none), in one process and on two workers; the tokens are plain decoding's."""
    from models import model_path

    path = model_path("qwen35", "Q8_0")
    prompt, n = PROMPT[:12], 30

    def run(pipeline, speculating):
        engine = Engine(pipeline)
        written = plain if speculating else []
        if speculating:
            scripted(engine, written, len(prompt))
        try:
            speculation = Speculation() if speculating else None
            handle = engine.submit(Request(prompt, GREEDY, max_tokens=n, ignore_eos=True, speculation=speculation))
            handle.result()
            assert handle.error is None, handle.error
            return handle.tokens, handle.stats
        finally:
            engine.close()

    plain: list[int] = []
    plain, _ = run(one_process(path), False)
    tokens, stats = run(one_process(path), True)
    assert tokens == plain
    assert 0 < stats.draft_n_accepted < stats.draft_n, (stats.draft_n, stats.draft_n_accepted)
    with on_two_workers(path, tmp_path) as pipeline:
        assert run(pipeline, False)[0] == plain
        tokens, stats = run(pipeline, True)
        assert tokens == plain and 0 < stats.draft_n_accepted < stats.draft_n


def test_a_draft_model_of_another_vocabulary_is_refused_before_anything_loads(copier, capsys):
    from shardwire.cli.main import main

    from models import model_path

    with pytest.raises(ValueError, match="vocabulary"):
        check_vocabularies(load_tokenizer(open_model(copier)), load_tokenizer(open_model(model_path("llama"))))
    assert main(["generate", str(copier), "-p", "Hello", "-n", "2", "-md", str(model_path("llama"))]) == 1
    assert "vocabulary" in capsys.readouterr().err


def test_draft_simple_without_a_draft_model_is_a_clear_error(copier):
    engine = Engine(one_process(copier))
    try:
        handle = engine.submit(Request(PROMPT, GREEDY, max_tokens=4, speculation=Speculation("draft-simple")))
        handle.result()
        assert handle.finish_reason == "error" and "-md" in handle.error
    finally:
        engine.close()


def test_over_two_workers_speculation_gives_the_tokens_of_one_process(copier, tmp_path):
    """On workers a speculating sequence's steps go ahead of the one in flight: while the reply
    copies its prompt they count; where it parts from the prompt they are void. Either way, with
    steps ahead or without, the tokens are plain decoding's."""
    reference, _, _ = generate(one_process(copier), GREEDY)
    ahead = void = 0
    with on_two_workers(copier, tmp_path) as pipeline:
        draft = draft_model(copier)
        for sampling in (GREEDY, SEEDED):
            plain, _, _ = generate(pipeline, sampling)
            for speculation in (Speculation(n_max=8), Speculation("draft-simple", n_max=8)):
                for go_ahead in (True, False):
                    tokens, stats, counters = generate(pipeline, sampling, speculation, draft=draft, ahead=go_ahead)
                    assert tokens == plain, (speculation.kind, go_ahead)
                    assert stats.draft_n_accepted >= len(REPLY) // 2
                    ahead, void = ahead + counters.ahead_steps, void + counters.void_steps
        assert plain == reference or sampling is SEEDED
    assert ahead > void > 0


async def _post(http, url: str, body: dict) -> tuple[int, dict]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


def test_requests_ask_for_speculation_with_llama_servers_fields_and_see_it_in_timings(copier, monkeypatch):
    """/completion's speculative.* fields; timings carry draft_n and draft_n_accepted, as
    llama-server's do, and /metrics counts them; a bad field is a 400 naming it."""
    import asyncio

    from aiohttp import ClientSession

    from shardwire.serving.state import ServerSettings

    from served import served

    model = open_model(copier)
    monkeypatch.setattr(core, "StepCosts", FreeWidth)

    async def run():
        stage = load_stage(model, 0, model.config.n_layers)
        settings = ServerSettings(metrics=True)
        async with served(stage, load_tokenizer(model), ctx=128, settings=settings) as base, ClientSession() as http:
            asked = {"prompt": PROMPT, "n_predict": len(REPLY), "temperature": 0}
            status, plain = await _post(http, f"{base}/completion", asked)
            assert status == 200 and "draft_n" not in plain["timings"]
            fields = {"speculative.type": "ngram-simple", "speculative.n_max": 6}
            status, spec = await _post(http, f"{base}/completion", {**asked, **fields})
            assert status == 200 and spec["content"] == plain["content"]
            timings = spec["timings"]
            assert timings["draft_n"] >= timings["draft_n_accepted"] >= len(REPLY) // 2
            async with http.get(f"{base}/metrics") as r:
                counted = {
                    line.split()[0]: float(line.split()[1])
                    for line in (await r.text()).splitlines()
                    if line.startswith(("llamacpp:spec_decode", "shardwire:spec_"))
                }
            assert counted["llamacpp:spec_decode_num_draft_tokens_total"] == timings["draft_n"]
            assert counted["llamacpp:spec_decode_num_accepted_tokens_total"] == timings["draft_n_accepted"]
            assert 0 < counted["llamacpp:spec_decode_num_drafts_total"] <= timings["draft_n"]
            assert counted["shardwire:spec_ahead_steps_total"] == 0  # one process: its stages take turns
            status, chat = await _post(
                http, f"{base}/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, **fields}
            )
            assert status == 200 and chat["choices"][0]["text"] == plain["content"][: len(chat["choices"][0]["text"])]
            for bad in (
                {"speculative.type": "eagle"},
                {**fields, "speculative.n_max": -1},
                {**fields, "speculative.ngram_size_n": 1},
            ):
                status, error = await _post(http, f"{base}/completion", {**asked, **bad})
                assert status == 400 and "speculative" in error["error"]["message"], error

    asyncio.run(run())


def test_generate_and_serve_take_llama_servers_speculative_flags():
    from shardwire.cli.generate import speculation_from_args
    from shardwire.cli.main import build_parser
    from shardwire.cli.serve import settings

    parser = build_parser()

    def generate_args(*flags):
        return speculation_from_args(parser.parse_args(["generate", "m.gguf", "-p", "x", *flags]))

    flags = ["--spec-type", "ngram-simple", "--draft-max", "5", "--draft-min", "2", "--spec-ngram-size-n", "4"]
    assert generate_args(*flags) == Speculation("ngram-simple", 5, 2, 4)
    current = ["--spec-type", "ngram-simple", "--spec-draft-n-max", "5", "--spec-draft-n-min", "2"]
    assert generate_args(*current, "--spec-ngram-simple-size-n", "4") == Speculation("ngram-simple", 5, 2, 4)
    assert generate_args() is None
    assert generate_args("-md", "d.gguf", "--draft-p-min", "0.5") == Speculation("draft-simple", p_min=0.5)
    assert generate_args("-md", "d.gguf", "--spec-type", "none") is None
    with pytest.raises(ValueError, match="-md"):
        generate_args("--spec-type", "draft-simple")
    defaults = settings(parser.parse_args(["serve", "m.gguf", *flags])).sampling
    assert {k: v for k, v in defaults.items() if k.startswith("speculative.")} == {
        "speculative.type": "ngram-simple",
        "speculative.n_max": 5,
        "speculative.n_min": 2,
        "speculative.ngram_size_n": 4,
        "speculative.p_min": 0.0,
    }
    bad = ["--spec-type", "ngram-simple", "--draft-min", "9", "--draft-max", "3"]
    with pytest.raises(ValueError, match="n_min"):
        settings(parser.parse_args(["serve", "m.gguf", *bad]))
