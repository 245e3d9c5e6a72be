"""Constrained decoding (JSON schema, GBNF, Lark) and logit_bias: grammars compiled on the
coordinator, matched next to the sampler on the last stage, replayed after a lost worker. A model
with random weights writes nonsense, so each output is checked to be valid, not to be sensible."""

from __future__ import annotations

import json
import re
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from shardwire.constrain import (
    MAX_GRAMMAR_BYTES,
    ConstraintError,
    Grammar,
    Matchers,
    RowConstraint,
    Vocabulary,
    vocabulary_of,
)
from shardwire.coordinator import Cluster
from shardwire.engine import Engine, Request
from shardwire.engine.drafting import Acceptance, Drafter, Speculation
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import SamplingParams
from shardwire.serving.openai_api import APIError, parse_chat, parse_completion
from shardwire.tokenizer import load_tokenizer
from shardwire.weights.in_use import compute_line

from models import PROMPT, hf_path, model_path
from serve_process import ServeProcess, call
from workers import WorkerProcess

WARM = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=11)
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "color", "tags", "ok"],
    "additionalProperties": False,
}
ANSWER = 'root ::= "yes" | "no" | "maybe " [0-9]{1,3}'
NUMBERS = {  # long enough to kill a worker in the middle of it
    "type": "array",
    "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 40,
    "maxItems": 40,
}


@pytest.fixture(scope="module")
def qwen2():
    model = open_model(model_path("qwen2", "F32"))
    return model, load_tokenizer(model)


@pytest.fixture(scope="module")
def vocabulary(qwen2):
    return vocabulary_of(qwen2[1])


@pytest.fixture(scope="module")
def local(qwen2):
    model, tokenizer = qwen2
    engine = Engine(LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=2, ctx=256), tokenizer)
    yield engine
    engine.close()


def run(engine, grammar=None, sampling=WARM, max_tokens=120, prompt=PROMPT):
    handle = engine.submit(Request(list(prompt), sampling, max_tokens=max_tokens, grammar=grammar))
    text = handle.result()
    assert handle.error is None, handle.error
    return text, handle


# -- the vocabulary and grammars ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["qwen2 gguf", "llama gguf", "qwen3 hf"])
def test_the_vocabulary_marks_control_tokens_and_round_trips_through_its_payload(source):
    name, form = source.split()
    path = model_path(name) if form == "gguf" else hf_path(name)
    tokenizer = load_tokenizer(open_model(path))
    vocab = vocabulary_of(tokenizer)
    assert len(vocab.tokens) == tokenizer.vocab_size and set(vocab.eos) == set(tokenizer.stop_ids)
    for i in vocab.eos:
        assert vocab.tokens[i].startswith(b"\xff")  # a grammar's text can never spell them
    hello = tokenizer.encode("hello world", add_special=False)
    assert b"".join(vocab.tokens[i] for i in hello).lstrip(b" ") == b"hello world"  # SentencePiece: " hello"
    again = Vocabulary.from_payload(vocab.to_payload(), len(vocab.tokens), vocab.eos)
    assert again.tokens == vocab.tokens and again.eos == vocab.eos


def test_json_mode_on_the_demo_model_whose_decoder_llguidance_cannot_read():
    """glassllm's tokenizer.json decodes by replacements llguidance does not know: its vocabulary
    is each token's own text. Its characters hold no '"', so the one object it can write is {}:
    JSON mode gives that at temperature 1, 20 of 20."""
    pytest.importorskip("glassllm")
    from shardwire_kit import glassllm

    model = open_model(glassllm.cached_glassllm_gguf())
    tokenizer = load_tokenizer(model)
    vocab = vocabulary_of(tokenizer)
    assert vocab.tokens[0] == b"\xff<pad>" and vocab.tokens[tokenizer.eos_id] == b"\xff<eos>"
    hello = tokenizer.encode("Alice was beginning", add_special=False)
    assert b"".join(vocab.tokens[i] for i in hello).lstrip(b" ") == b"Alice was beginning"
    grammar = Grammar.compile("json_schema", {"type": "object"}, vocab)
    engine = Engine(LocalPipeline([load_stage(model, 0, model.config.n_layers)], n_slots=1, ctx=128), tokenizer)
    try:
        seeds = [SamplingParams(temperature=1.0, seed=seed) for seed in range(20)]
        assert [json.loads(run(engine, grammar, sampling, max_tokens=16)[0]) for sampling in seeds] == [{}] * 20
    finally:
        engine.close()


def test_a_vocabulary_payload_that_does_not_add_up_is_refused(vocabulary):
    payload = vocabulary.to_payload()
    with pytest.raises(ValueError, match="do not add up"):
        Vocabulary.from_payload(payload[:-1], len(vocabulary.tokens), vocabulary.eos)
    with pytest.raises(ValueError, match="cannot hold"):
        Vocabulary.from_payload(b"\0" * 8, 3, [0])


@pytest.mark.parametrize(
    "kind, source, message",
    [
        ("json_schema", {"type": "frobnicate"}, "Invalid type: frobnicate"),
        ("json_schema", "{not json", "invalid json_schema"),
        ("json_schema", {"type": "string", "pattern": "[unclosed"}, "invalid json_schema"),
        ("gbnf", "root ::= undefined", "Rule 'undefined' not found"),
        ("gbnf", 'root ::= "a', "Unexpected end of input"),
        ("lark", "start: /[/", "unclosed character class"),
        ("json_schema", {"type": "string", "pattern": "a" * (MAX_GRAMMAR_BYTES + 1)}, "larger than 128 KiB"),
    ],
)
def test_invalid_grammars_are_refused_with_the_engine_s_message(vocabulary, kind, source, message):
    with pytest.raises(ConstraintError, match=re.escape(message)):
        Grammar.compile(kind, source, vocabulary)


def test_a_regex_with_an_exponential_automaton_stays_cheap(vocabulary):
    """llguidance builds its lexer lazily under fuel limits: a pattern whose DFA has 2^40 states
    compiles and matches in milliseconds."""
    start = time.monotonic()
    grammar = Grammar.compile("json_schema", {"type": "string", "pattern": "^(a|b)*a(a|b){40}$"}, vocabulary)
    matchers = Matchers()
    matchers.use_vocabulary(vocabulary)
    matchers.prepare(0, RowConstraint(grammar.key, 0, grammar.text, []))
    for _ in range(30):
        allowed = matchers.allowed(0, len(vocabulary.tokens)).nonzero().flatten().tolist()
        matchers.consume(0, allowed[len(allowed) // 2])
    assert time.monotonic() - start < 5


def test_a_row_constraint_is_checked_as_it_comes_off_the_wire():
    key = "a" * 64
    assert RowConstraint.from_dict({"key": key, "consumed": 2, "grammar": "g", "tokens": [4, 5]}).tokens == [4, 5]
    for bad in [
        {"key": "short", "consumed": 0},
        {"key": key, "consumed": -1},
        {"key": key, "consumed": 1, "grammar": "g", "tokens": []},  # rebuilt from exactly `consumed` tokens
        {"key": key, "consumed": 0, "tokens": []},
        {"key": key, "consumed": 0, "extra": 1},
    ]:
        with pytest.raises(ValueError):
            RowConstraint.from_dict(bad)


def test_a_matcher_out_of_step_with_its_row_is_an_error(vocabulary):
    grammar = Grammar.compile("gbnf", ANSWER, vocabulary)
    matchers = Matchers()
    matchers.use_vocabulary(vocabulary)
    with pytest.raises(ValueError, match="not at the row's token"):
        matchers.prepare(0, RowConstraint(grammar.key, 0))  # never built
    matchers.prepare(0, RowConstraint(grammar.key, 0, grammar.text, []))
    matchers.prepare(0, RowConstraint(grammar.key, 0))
    with pytest.raises(ValueError, match="not at the row's token"):
        matchers.prepare(0, RowConstraint(grammar.key, 3))


# -- in one process ------------------------------------------------------------------------------


def test_json_schema_output_validates_at_temperature_one(local, vocabulary):
    grammar = Grammar.compile("json_schema", PERSON, vocabulary)
    for seed in range(8):
        text, handle = run(local, grammar, SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed))
        assert handle.finish_reason == "stop"
        jsonschema.validate(json.loads(text), PERSON)


def test_gbnf_and_lark_outputs_match_their_grammars(local, vocabulary):
    answer = Grammar.compile("gbnf", ANSWER, vocabulary)
    word = Grammar.compile("lark", 'start: "<" /[a-z]{2,8}/ ">"', vocabulary)
    for seed in range(4):
        sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        assert re.fullmatch(r"yes|no|maybe [0-9]{1,3}", run(local, answer, sampling)[0])
        assert re.fullmatch(r"<[a-z]{2,8}>", run(local, word, sampling)[0])


def test_greedy_and_penalized_sampling_follow_the_grammar_too(local, vocabulary):
    grammar = Grammar.compile("json_schema", PERSON, vocabulary)
    for sampling in [SamplingParams(temperature=0.0), SamplingParams(repeat_penalty=1.5, seed=3, logprobs=2)]:
        jsonschema.validate(json.loads(run(local, grammar, sampling)[0]), PERSON)


class Offering(Drafter):
    """Proposes the same tokens at every step."""

    def __init__(self, tokens: list[int]):
        super().__init__(Speculation(n_max=len(tokens)))
        self.tokens = tokens

    def propose(self, tokens, costs, room):
        return self.tokens[:room]


@pytest.mark.parametrize("offered", ["hello world", "1, 2, 3, 4"])
def test_a_speculating_request_sends_only_the_proposals_its_grammar_allows(local, qwen2, vocabulary, offered):
    """The coordinator follows the grammar with a matcher of its own: words in a JSON array of
    integers are never sent, digits are where the grammar allows them; the output is what the
    request gives without speculation."""
    engine = local
    grammar = Grammar.compile("json_schema", NUMBERS, vocabulary)
    tokens = qwen2[1].encode(offered, add_special=False)
    plain = run(engine, grammar, max_tokens=60)[1]
    drafter = Offering(tokens)
    engine.acceptance.setdefault("ngram-simple", Acceptance())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "_drafter", lambda speculation, slot: drafter)
        handle = engine.submit(
            Request(list(PROMPT), WARM, max_tokens=60, grammar=grammar, speculation=Speculation(n_max=4))
        )
        handle.result()
    assert handle.error is None and handle.tokens == plain.tokens
    if offered == "hello world":
        assert handle.stats.draft_n == 0
    else:
        assert handle.stats.draft_n > 0


def test_logit_bias_raises_bans_and_leaves_other_tokens(local):
    greedy = SamplingParams(temperature=0.0)
    _, free = run(local, sampling=greedy, max_tokens=4)
    first = free.tokens[0]
    _, banned = run(local, sampling=SamplingParams(temperature=0.0, logit_bias=((first, float("-inf")),)), max_tokens=1)
    assert banned.tokens[0] != first
    _, pushed = run(local, sampling=SamplingParams(temperature=0.0, logit_bias=((777, 100.0),)), max_tokens=3)
    assert pushed.tokens == [777, 777, 777]
    _, small = run(local, sampling=SamplingParams(temperature=0.0, logit_bias=((777, 1e-4),)), max_tokens=4)
    assert small.tokens == free.tokens
    # The reported logprobs are the model's own, before the bias.
    _, seen = run(local, sampling=SamplingParams(temperature=0.0, logit_bias=((777, 100.0),), logprobs=1), max_tokens=1)
    assert seen.tokens == [777]


# -- the API's fields, parsed with a real tokenizer ---------------------------------------------------


def chat(**fields):
    return {"messages": [{"role": "user", "content": "hi"}], **fields}


def test_every_way_to_ask_for_a_constraint(qwen2):
    tokenizer = qwen2[1]
    schema_job = parse_chat(chat(response_format={"type": "json_schema", "json_schema": {"schema": PERSON}}), tokenizer)
    assert schema_job.grammar is not None and schema_job.requests(256)[0].grammar == schema_job.grammar
    assert parse_chat(chat(json_schema=PERSON), tokenizer).grammar == schema_job.grammar  # llama-server's field
    assert parse_chat(chat(response_format={"type": "json_object"}), tokenizer).grammar is not None
    assert parse_completion({"prompt": "a", "grammar": ANSWER}, tokenizer).grammar is not None
    assert parse_chat(chat(response_format={"type": "text"}, grammar=""), tokenizer).grammar is None


@pytest.mark.parametrize(
    "fields, param, fragment",
    [
        (
            dict(response_format={"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}),
            "response_format",
            "type: x",
        ),
        (dict(response_format={"type": "json_schema", "json_schema": {}}), "response_format", "json_schema.schema"),
        (dict(response_format={"type": "xml"}), "response_format", "response_format.type must be"),
        (dict(response_format="json"), "response_format", "response_format.type must be"),
        (dict(json_schema="not a schema"), "json_schema", "must be a JSON schema object"),
        (dict(grammar="root ::= nowhere"), "grammar", "Rule 'nowhere' not found"),
        (dict(grammar=["root"]), "grammar", "GBNF grammar in a string"),
        (dict(grammar=ANSWER, json_schema=PERSON), "grammar", "only one of"),
        (dict(logit_bias={"5": 101}), "logit_bias", "[-100, 100]"),
        (dict(logit_bias={"5": "x"}), "logit_bias", "[-100, 100]"),
        (dict(logit_bias={"99999999": 1}), "logit_bias", "not in the vocabulary"),
        (dict(logit_bias={"-3": 1}), "logit_bias", "not in the vocabulary"),
        (dict(logit_bias=[[5]]), "logit_bias", "must map token ids"),
        (dict(logit_bias={str(i): 1 for i in range(1025)}), "logit_bias", "at most 1024"),
    ],
)
def test_bad_constraints_and_biases_are_400s(qwen2, fields, param, fragment):
    with pytest.raises(APIError) as info:
        parse_chat(chat(**fields), qwen2[1])
    assert info.value.status == 400 and info.value.param == param and fragment in info.value.message


def test_logit_bias_forms(qwen2):
    tokenizer = qwen2[1]
    comma = tokenizer.encode(",", add_special=False)
    assert len(comma) == 1
    assert parse_chat(chat(logit_bias={"5": 3, "7": -100}), tokenizer).sampling.logit_bias == ((5, 3.0), (7, -100.0))
    listed = parse_chat(chat(logit_bias=[[5, 2.5], [",", False]]), tokenizer).sampling.logit_bias
    assert listed == tuple(sorted([(5, 2.5), (comma[0], float("-inf"))]))
    assert parse_chat(chat(logit_bias={",": 1}), tokenizer).sampling.logit_bias == ((comma[0], 1.0),)


# -- across workers -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    workers = [WorkerProcess(tmp_path_factory.mktemp("worker")).start() for _ in range(2)]
    serve = ServeProcess(model_path("qwen2", "F32"), workers, tmp_path_factory.mktemp("coordinator"))
    yield serve
    serve.stop()
    for w in workers:
        w.stop()


@pytest.mark.slow
def test_strict_json_schema_validates_in_every_sampled_request_through_two_workers(server):
    workers = call(server.url, "/v1/cluster")[1]["cluster"]["workers"]
    assert [w["stages"][0]["blocks"] for w in workers] == [[0, 2], [2, 4]]
    assert all(d["compute"] == compute_line(d["name"]) for w in workers for d in w["devices"])  # as each worker said
    body = {
        "messages": [{"role": "user", "content": "Describe a person."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        "temperature": 1.0,
        "max_tokens": 120,
    }

    def ask(seed):
        return call(server.url, "/v1/chat/completions", dict(body, seed=seed))

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(20)))
    for status, answer in answers:
        assert status == 200, answer
        choice = answer["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["message"]["content"]), PERSON)


@pytest.mark.slow
def test_grammar_json_schema_and_logit_bias_on_completions_through_two_workers(server):
    status, answer = call(server.url, "/v1/completions", {"prompt": "Well?", "grammar": ANSWER, "max_tokens": 20})
    assert status == 200 and re.fullmatch(r"yes|no|maybe [0-9]{1,3}", answer["choices"][0]["text"]), answer
    status, answer = call(server.url, "/v1/completions", {"prompt": "Who?", "json_schema": PERSON, "max_tokens": 120})
    assert status == 200, answer
    jsonschema.validate(json.loads(answer["choices"][0]["text"]), PERSON)
    # JSON mode: a random model never closes its strings, so a bias on '"' and '}' lets it end
    status, answer = call(
        server.url,
        "/v1/chat/completions",
        dict(chat(), response_format={"type": "json_object"}, logit_bias={"}": 100, '"': 100}),
    )
    assert status == 200 and isinstance(json.loads(answer["choices"][0]["message"]["content"]), dict), answer
    status, answer = call(
        server.url, "/v1/completions", {"prompt": "a", "logit_bias": {"777": 100}, "temperature": 0, "max_tokens": 3}
    )
    assert status == 200 and answer["usage"]["completion_tokens"] == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"json_schema": {"type": "frobnicate"}}, "Invalid type: frobnicate"),
        ({"grammar": "root ::= nowhere"}, "Rule 'nowhere' not found"),
        ({"logit_bias": {"5": -101}}, "[-100, 100]"),
        ({"logit_bias": {"1000000": 1}}, "not in the vocabulary"),
    ],
)
def test_bad_grammars_and_biases_are_400s_over_http(server, body, fragment):
    for path, base in [("/v1/completions", {"prompt": "a"}), ("/v1/chat/completions", chat())]:
        status, answer = call(server.url, path, {**base, **body})
        assert status == 400 and fragment in answer["error"]["message"], answer


# -- recovery ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_constrained_sequence_replayed_after_its_sampling_worker_dies_continues_identically(tmp_path, qwen2):
    model, tokenizer = qwen2
    workers = [WorkerProcess(tmp_path / f"cache{i}").start() for i in range(2)]
    cluster = Cluster([w.address for w in workers], cache_dir=tmp_path / "coord", show_progress=False)
    cluster.heartbeat.interval, cluster.heartbeat.dead_after = 0.25, 1.5
    cluster.heartbeat.stall_timeout, cluster.recovery_timeout = 3.0, 20.0
    engine = None
    try:
        cluster.connect(model)
        pipeline = cluster.load(cluster.make_plan(ctx=256, n_slots=2, prefill_chunk=8, tensor_split=[1, 1]))
        assert len(cluster.plan.stages) == 2
        engine = Engine(pipeline, tokenizer, prefill_chunk=8)
        grammar = Grammar.compile("json_schema", NUMBERS, vocabulary_of(tokenizer))
        _, uninterrupted = run(engine, grammar, max_tokens=200)
        handle = engine.submit(Request(list(PROMPT), WARM, max_tokens=200, grammar=grammar))
        deadline = time.monotonic() + 30
        while len(handle.tokens) < 10:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        sampler = cluster.plan.stages[-1].device.worker
        next(w for w in workers if w.address == sampler).kill()
        text = handle.result()
        assert handle.error is None, handle.error
        assert handle.tokens == uninterrupted.tokens
        assert 10 < cluster.events[-1]["replayed_tokens"] and cluster.events[-1]["recovered"]
        jsonschema.validate(json.loads(text), NUMBERS)
    finally:
        if engine is not None:
            engine.close()
        cluster.close()
        for w in workers:
            w.stop()
