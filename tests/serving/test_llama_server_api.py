"""llama-server's native API (/completion, /apply-template, /props, /slots, /metrics) and the
server flags that set request defaults: a real model, its real tokenizer, real HTTP on loopback.

Most tests drive the app in this process over one engine (quick); the last ones start
`shardwire serve` itself to see its flags arrive."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from unittest.mock import ANY

import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from shardwire.engine import Engine, Request
from shardwire.enums import PAGE
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import SamplingParams
from shardwire.serving.app import create_app
from shardwire.serving.chat_templates import BUILTIN
from shardwire.serving.cors import CorsPolicy
from shardwire.serving.state import Backend, ServerSettings
from shardwire.tokenizer import load_tokenizer

from models import model_path

CTX = 128
SLOTS = 2
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def model():
    return model_path("qwen2", "F32")  # Qwen's vocabulary and chat template


@pytest.fixture(scope="module")
def engine(model):
    m = open_model(model)
    tokenizer = load_tokenizer(m)
    engine = Engine(LocalPipeline([load_stage(m, 0, m.config.n_layers)], n_slots=SLOTS, ctx=CTX), tokenizer)
    yield engine
    engine.close()


class AppThread:
    """create_app over the shared engine, served from an event loop on a thread of its own."""

    def __init__(self, engine: Engine, settings: ServerSettings | None = None, **app_options):
        self.backend = Backend("tiny", engine.tokenizer, set(), {}, settings)
        self.backend.attach(engine.pipeline, None, engine)
        self.loop = asyncio.new_event_loop()
        started = threading.Event()

        async def start():
            self.runner = web.AppRunner(create_app(self.backend, **app_options))
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", 0).start()
            self.url = "http://%s:%d" % self.runner.addresses[0][:2]
            started.set()

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        started.wait(30)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


def call(url: str, path: str, body=None, headers: dict | None = None, raw: bool = False):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(
        url + path,
        data=data,
        headers={"Content-Type": "application/json", **(headers or {})},
        method="POST" if data is not None else "GET",
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            text = r.read().decode()
            return r.status, (text if raw else json.loads(text)), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def events(url: str, path: str, body: dict) -> list[dict]:
    """The `data:` lines of a server-sent event stream, decoded."""
    req = urllib.request.Request(
        url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        lines = r.read().decode().split("\n\n")
    assert "data: [DONE]" not in lines  # the OpenAI endpoints' end, not llama-server's native one
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.fixture(scope="module")
def server(engine):
    app = AppThread(engine)
    yield app
    app.stop()


def greedy(engine: Engine, prompt: list[int], n: int) -> tuple[str, list[int]]:
    handle = engine.submit(Request(prompt, SamplingParams(temperature=0.0), max_tokens=n))
    text = handle.result()
    return text, handle.tokens


# -- POST /completion --------------------------------------------------------------------------


def test_completion_answers_in_llama_servers_shape(server, engine):
    tok = engine.tokenizer
    ids = tok.encode(PROMPT, add_special=True, parse_special=True)
    text, tokens = greedy(engine, ids, 8)
    code, body, _ = call(server.url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})
    assert code == 200, body
    assert body["content"] == text and body["tokens"] == []  # tokens only with return_tokens
    assert body["stop"] is True and body["stop_type"] == "limit" and body["stopping_word"] == ""
    assert body["tokens_predicted"] == 8 and body["tokens_evaluated"] == len(ids)
    assert body["truncated"] is False and isinstance(body["has_new_line"], bool)
    timings = body["timings"]
    assert timings["prompt_n"] == len(ids) and timings["predicted_n"] == 8
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0
    settings = body["generation_settings"]
    assert settings["n_predict"] == 8 and settings["temperature"] == 0 and settings["n_ctx"] == CTX
    assert body["model"] == "tiny" and body["prompt"] == tok.decode(ids, skip_special=False)

    returned = call(
        server.url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0, "return_tokens": True}
    )
    assert returned[1]["tokens"] == tokens
    assert call(server.url, "/detokenize", {"tokens": tokens})[1]["content"] == text


def test_prompt_as_tokens_mixed_and_several(server, engine):
    tok = engine.tokenizer
    ids = call(server.url, "/tokenize", {"content": PROMPT, "add_special": True})[1]["tokens"]
    one = {"n_predict": 6, "temperature": 0, "cache_prompt": False}
    by_text = call(server.url, "/completion", {**one, "prompt": PROMPT})[1]
    by_ids = call(server.url, "/completion", {**one, "prompt": ids})[1]
    assert by_ids["content"] == by_text["content"] and by_ids["tokens_evaluated"] == len(ids)

    both = call(server.url, "/completion", {**one, "prompt": [ids, PROMPT]})[1]
    assert isinstance(both, list) and [r["index"] for r in both] == [0, 1]
    assert both[0]["content"] == both[1]["content"] == by_text["content"]

    head, tail = "Once upon", " a time"
    mixed = [*tok.encode(head, add_special=True), tail]  # a string after ids gets no BOS
    code, body, _ = call(server.url, "/completion", {**one, "prompt": mixed})
    expected = tok.encode(head, add_special=True) + tok.encode(tail, add_special=False)
    assert code == 200 and body["tokens_evaluated"] == len(expected)


def test_stream_sends_each_token_then_the_totals(server):
    request = {"prompt": PROMPT, "n_predict": 8, "temperature": 0}
    whole = call(server.url, "/completion", request)[1]
    chunks = events(server.url, "/completion", {**request, "stream": True})
    assert all(isinstance(c["stop"], bool) for c in chunks)
    *tokens, last = chunks
    assert all(len(c["tokens"]) == 1 and not c["stop"] for c in tokens) and len(tokens) == 8
    assert "".join(c["content"] for c in chunks) == whole["content"]
    assert last["stop"] and last["stop_type"] == "limit" and last["timings"]["predicted_n"] == 8
    assert last["generation_settings"]["n_predict"] == 8 and last["content"] == ""


def test_return_progress_tells_how_far_the_prompt_is(server, engine):
    """llama-server's return_progress: an event at the cached part, one as each prompt chunk is
    back, the last at the whole prompt, all before the first token; a repeat finds pages cached."""
    body = {"prompt": "The quick brown fox jumps over the lazy dog. " * 6, "n_predict": 2, "temperature": 0}
    body |= {"stream": True, "return_progress": True, "timings_per_token": True}
    engine.prefill_chunk, chunk = 16, engine.prefill_chunk
    try:
        for turn in range(2):
            chunks = events(server.url, "/completion", body)
            progress = [c for c in chunks if "prompt_progress" in c]
            assert chunks[: len(progress)] == progress and all(c["content"] == "" for c in progress)
            reached = [c["prompt_progress"] for c in progress]
            cached, total = reached[0]["cache"], reached[0]["total"]
            assert (cached > 0) == (turn == 1) and {r["cache"] for r in reached} == {cached}
            assert [r["processed"] for r in reached] == [cached, *range(cached + 16, total, 16), total]
            assert reached[0]["time_ms"] <= reached[-1]["time_ms"]
            timings = [c["timings"] for c in progress]
            assert timings[0]["prompt_n"] == 0 and timings[0]["prompt_ms"] == 0.0
            assert timings[-1]["prompt_n"] == total - cached and timings[-1]["prompt_ms"] > 0
            assert all(v >= 0 for t in timings for v in t.values())
        chat = {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "stream": True,
            "return_progress": True,
        }
        req = urllib.request.Request(
            server.url + "/v1/chat/completions",
            data=json.dumps(chat).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            lines = [json.loads(x[6:]) for x in r.read().decode().split("\n\n") if x.startswith("data: {")]
        first = next(c for c in lines if "prompt_progress" in c)
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": None}
        assert "prompt_progress" not in call(server.url, "/completion", {**body, "stream": False})[1]
    finally:
        engine.prefill_chunk = chunk


def test_n_probs_whole_streamed_and_post_sampling(server):
    request = {"prompt": PROMPT, "n_predict": 5, "n_probs": 3, "temperature": 0}
    body = call(server.url, "/completion", request)[1]
    probs = body["completion_probabilities"]
    assert len(probs) == 5
    for entry in probs:
        assert {"id", "token", "bytes", "logprob", "top_logprobs"} <= set(entry) and entry["logprob"] <= 0
        assert len(entry["top_logprobs"]) == 3 and entry["top_logprobs"][0]["id"] == entry["id"]  # greedy
        assert all(t["logprob"] <= 0 and isinstance(t["bytes"], list) for t in entry["top_logprobs"])
    assert "".join(e["token"] for e in probs) == body["content"]

    streamed = events(server.url, "/completion", {**request, "stream": True})
    assert [len(c["completion_probabilities"]) for c in streamed if not c["stop"]] == [1] * 5

    post = call(server.url, "/completion", {**request, "post_sampling_probs": True})[1]["completion_probabilities"]
    assert all(0 < e["prob"] <= 1 and len(e["top_probs"]) == 3 for e in post)


def test_stop_words_more_than_four(server):
    full = call(server.url, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0})[1]["content"]
    cut = full[len(full) // 2 :][:3]
    assert cut.strip()
    stops = ["zq#1", "zq#2", "zq#3", "zq#4", "zq#5", cut]
    body = call(server.url, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "stop": stops})[1]
    assert body["content"] == full[: full.index(cut)]
    assert body["stop_type"] == "word" and body["stopping_word"] == cut
    assert body["generation_settings"]["stop"] == stops
    openai_style = call(
        server.url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "stop": stops}
    )
    assert openai_style[0] == 200 and openai_style[1]["choices"][0]["text"] == body["content"]


def test_seed_makes_sampling_repeatable(server):
    request = {"prompt": PROMPT, "n_predict": 10, "temperature": 1.0, "seed": 42}
    first, again = (call(server.url, "/completion", request)[1] for _ in range(2))
    assert first["content"] == again["content"] and first["generation_settings"]["seed"] == 42
    randoms = {
        call(server.url, "/completion", {**request, "seed": -1})[1]["generation_settings"]["seed"] for _ in range(3)
    }
    assert len(randoms) > 1  # -1: a new seed each time


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": {"text": "hi"}}, "prompt"),
        ({"prompt": [10**9]}, "prompt"),
        ({"prompt": [1, None]}, "prompt"),
        ({"prompt": "hi", "n_predict": -2}, "n_predict"),
        ({"prompt": "hi", "n_predict": "8"}, "n_predict"),
        ({"prompt": "hi", "n_probs": 21}, "n_probs"),
        ({"prompt": "hi", "cache_prompt": "yes"}, "cache_prompt"),
        ({"prompt": "hi", "stop": [1]}, "stop"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "tick tock " * 100}, "prompt"),
    ],
)
def test_bad_completion_requests_are_clear_400s(server, body, param):
    code, answer, _ = call(server.url, "/completion", body)
    assert code == 400, answer
    assert answer["error"]["message"] and answer["error"]["param"] == param


def test_completions_prompt_objects_and_response_fields(server):
    """/completions is llama-server's native endpoint too; {"prompt_string"} is a prompt;
    response_fields picks fields, "a/b" from inside "a"."""
    one = {"n_predict": 4, "temperature": 0}
    by_text = call(server.url, "/completion", {**one, "prompt": PROMPT})[1]
    code, body, _ = call(server.url, "/completions", {**one, "prompt": {"prompt_string": PROMPT}})
    assert code == 200 and body["content"] == by_text["content"] and body["stop_type"] == "limit"
    both = call(server.url, "/completion", {**one, "prompt": [PROMPT, {"prompt_string": PROMPT}]})[1]
    assert [b["content"] for b in both] == [by_text["content"]] * 2
    image = {"prompt_string": PROMPT, "multimodal_data": ["iVBORw0KGgo="]}
    code, body, _ = call(server.url, "/completion", {**one, "prompt": image})
    assert code == 400 and "multimodal" in body["error"]["message"]

    fields = ["content", "generation_settings/n_predict", "timings/predicted_n", "no_such_field"]
    body = call(server.url, "/completion", {**one, "prompt": PROMPT, "response_fields": fields})[1]
    assert body == {"content": by_text["content"], "generation_settings/n_predict": 4, "timings/predicted_n": 4}
    assert call(server.url, "/completion", {**one, "prompt": PROMPT, "response_fields": "content"})[0] == 400


def test_generation_settings_list_the_logit_biases(server):
    """As llama-server lists them: a ban (-inf) is null."""
    one = {"prompt": PROMPT, "n_predict": 2, "temperature": 0}
    assert call(server.url, "/completion", one)[1]["generation_settings"]["logit_bias"] == []
    biased = call(server.url, "/completion", {**one, "logit_bias": [[5, 2.5], [7, False]]})[1]
    assert biased["generation_settings"]["logit_bias"] == [{"bias": 2.5, "token": 5}, {"bias": None, "token": 7}]


def test_ignore_eos_bans_the_end_of_generation_tokens(server, engine):
    """As llama-server: listed as bans, and never sampled, even when a bias pushes them."""
    stops = sorted(engine.tokenizer.stop_ids)
    pushed = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "logit_bias": [[t, 100] for t in stops]}
    assert call(server.url, "/completion", pushed)[1]["tokens_predicted"] == 1  # the pushed EOS ends it
    body = call(server.url, "/completion", {**pushed, "ignore_eos": True, "return_tokens": True})[1]
    assert body["generation_settings"]["logit_bias"] == [{"bias": None, "token": t} for t in stops]
    assert body["tokens_predicted"] == 6 and not set(body["tokens"]) & set(stops)


def test_timings_rate_the_decode_steps_after_the_first_token(server):
    """The first token comes with the prompt: n tokens are n - 1 decode steps, as llama-server counts."""
    one = call(server.url, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0})[1]["timings"]
    assert one["predicted_n"] == 1 and one["predicted_per_second"] == 0 and one["predicted_per_token_ms"] == 0
    eight = call(server.url, "/completion", {"prompt": PROMPT, "n_predict": 8, "temperature": 0})[1]["timings"]
    assert eight["predicted_per_second"] == pytest.approx(7 / eight["predicted_ms"] * 1000)
    assert eight["predicted_per_token_ms"] == pytest.approx(eight["predicted_ms"] / 7)


def test_a_prompt_past_the_context_is_llama_servers_error(server, engine):
    code, body, _ = call(server.url, "/completion", {"prompt": "tick tock " * 100})
    error = body["error"]
    assert code == 400 and error["type"] == "exceed_context_size_error" and error["code"] == "context_length_exceeded"
    assert "exceeds the available context size" in error["message"]
    assert error["n_ctx"] == CTX and error["n_prompt_tokens"] == len(engine.tokenizer.encode("tick tock " * 100))


def test_openai_answers_carry_llama_servers_extras(server):
    """system_fingerprint ("b..." as llama-server's build) and timings, whole and in the usage chunk."""
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}
    code, body, _ = call(server.url, "/v1/chat/completions", chat)
    assert code == 200 and body["system_fingerprint"].startswith("b")
    assert body["timings"]["predicted_n"] == body["usage"]["completion_tokens"]
    assert "timings" not in call(server.url, "/v1/chat/completions", {**chat, "n": 2})[1]  # one choice's only
    req = urllib.request.Request(
        server.url + "/v1/chat/completions",
        data=json.dumps({**chat, "stream": True, "stream_options": {"include_usage": True}}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.read().decode().split("\n\n") if line.startswith("data: {")]
    assert all(c["system_fingerprint"].startswith("b") for c in chunks)
    assert (
        chunks[-1]["choices"] == [] and chunks[-1]["timings"]["predicted_n"] == chunks[-1]["usage"]["completion_tokens"]
    )
    assert all("timings" not in c for c in chunks[:-1])


def test_chat_input_tokens_count_the_rendered_prompt(server, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = engine.tokenizer.apply_chat_template(messages)
    expected = len(engine.tokenizer.encode(prompt, add_special=False, parse_special=True))
    for path in ("/chat/completions/input_tokens", "/v1/chat/completions/input_tokens"):
        assert call(server.url, path, {"messages": messages}) == (200, {"input_tokens": expected}, ANY)
    assert call(server.url, "/v1/chat/completions/input_tokens", {"messages": []})[0] == 400


def test_tokenize_pieces_are_text_or_bytes(server, engine):
    """A piece that is not UTF-8 on its own (part of a character) comes as its bytes, as llama-server's."""
    text = "emoji 🤗 媽"
    pieces = call(server.url, "/tokenize", {"content": text, "with_pieces": True})[1]["tokens"]
    assert [p["id"] for p in pieces] == engine.tokenizer.encode(text, add_special=False, parse_special=True)
    assert any(isinstance(p["piece"], list) for p in pieces) and any(isinstance(p["piece"], str) for p in pieces)
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined.decode() == text


def test_bad_json_and_bad_messages(server):
    assert call(server.url, "/completion", b'{"prompt": ')[0] == 400
    assert call(server.url, "/completion", b"[1, 2]")[0] == 400
    assert call(server.url, "/apply-template", {"messages": "hi"})[0] == 400
    assert call(server.url, "/apply-template", {"messages": [{"role": "robot", "content": "x"}]})[0] == 400


# -- templates and server state ----------------------------------------------------------------


def test_apply_template_is_what_chat_continues(server, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    code, body, _ = call(server.url, "/apply-template", {"messages": messages})
    assert code == 200 and body["prompt"] == engine.tokenizer.apply_chat_template(messages)
    assert "<|im_start|>user\nHi" in body["prompt"]
    bare = call(server.url, "/apply-template", {"messages": messages, "add_generation_prompt": False})[1]["prompt"]
    assert body["prompt"] == bare + "<|im_start|>assistant\n"


def test_props_and_slots(server, engine):
    code, props, _ = call(server.url, "/props")
    assert code == 200 and props["total_slots"] == SLOTS and props["n_ctx"] == CTX
    assert props["chat_template"] == engine.tokenizer.chat_template
    params = props["default_generation_settings"]["params"]
    assert params["temperature"] == 0.8 and params["top_k"] == 40 and params["n_predict"] == -1  # llama.cpp's

    wait_idle(server.url)
    code, slots, _ = call(server.url, "/slots")
    assert code == 200 and [s["id"] for s in slots] == list(range(SLOTS))
    # an idle slot, as llama-server shows one: no request, so no params or next_token
    assert all(s == {"id": s["id"], "n_ctx": CTX, "speculative": False, "is_processing": False} for s in slots)

    req = urllib.request.Request(
        server.url + "/completion",
        data=json.dumps({"prompt": PROMPT, "n_predict": 100, "stream": True, "ignore_eos": True}).encode(),
    )
    with urllib.request.urlopen(req, timeout=60) as stream:
        stream.readline()  # the first token is out: the sequence holds a slot
        busy = [s for s in call(server.url, "/slots")[1] if s["is_processing"]]
        assert len(busy) == 1 and busy[0]["params"]["n_predict"] == 100
        assert busy[0]["next_token"][0]["n_remain"] == 100 - busy[0]["next_token"][0]["n_decoded"]
        assert busy[0]["n_prompt_tokens"] == len(engine.tokenizer.encode(PROMPT))
    wait_idle(server.url)  # the client left: its sequence is cancelled


def wait_idle(url: str, timeout: float = 10) -> None:
    """Until no slot is processing (the engine frees a slot just after a request's last token)."""
    deadline = time.monotonic() + timeout
    while any(s["is_processing"] for s in call(url, "/slots")[1]):
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics_need_the_flag(server):
    code, body, _ = call(server.url, "/metrics")
    assert code == 501 and "--metrics" in body["error"]["message"]


def test_slots_can_be_turned_off(engine):
    app = AppThread(engine, slots=False)  # --no-slots
    try:
        code, body, _ = call(app.url, "/slots")
        assert code == 501 and body["error"]["type"] == "not_supported_error"
        assert call(app.url, "/props")[0] == 200
    finally:
        app.stop()


def test_metrics_in_prometheus_format(engine):
    app = AppThread(engine, ServerSettings(metrics=True))
    try:
        call(app.url, "/completion", {"prompt": PROMPT * 5, "n_predict": 4, "temperature": 0})
        call(app.url, "/v1/completions", {"prompt": PROMPT * 5, "max_tokens": 3, "temperature": 0})
        deadline = time.monotonic() + 5
        while True:  # the engine frees a slot just after it hands out the last token
            code, text, headers = call(app.url, "/metrics", raw=True)
            samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
            if samples["llamacpp:requests_processing"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        app.stop()
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    assert abs(int(headers["Process-Start-Time-Unix"]) - time.time()) < 24 * 3600
    prompt_n = len(engine.tokenizer.encode(PROMPT * 5))
    assert prompt_n > PAGE and samples["llamacpp:prompt_tokens_cached_total"] == PAGE  # the second reused a page
    assert samples["llamacpp:prompt_tokens_total"] == 2 * prompt_n - PAGE
    # the engine's counters, since it started (other tests use it too)
    assert samples["llamacpp:n_decode_total"] >= 2 + 5 and 1 <= samples["llamacpp:n_busy_slots_per_decode"] <= SLOTS
    # typed and named as llama-server's: a counter without _total
    most = re.search(r"^llamacpp:n_tokens_max ([0-9.]+)$", text, re.M)
    assert "# TYPE llamacpp:n_tokens_max counter" in text and float(most.group(1)) >= prompt_n + 4
    kv = {
        s.labels["state"]: s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "shardwire:kv_pages"
    }
    assert kv["in_use"] == 0 and kv["cached"] >= 1 and sum(kv.values()) == engine.pipeline.kv_pages
    assert samples["llamacpp:tokens_predicted_total"] == 7
    assert samples["llamacpp:prompt_seconds_total"] > 0 and samples["llamacpp:tokens_predicted_seconds_total"] > 0
    assert samples["llamacpp:predicted_tokens_seconds"] > 0
    assert samples["llamacpp:requests_processing"] == 0 and samples["llamacpp:requests_deferred"] == 0
    assert samples["shardwire:slots"] == SLOTS and samples["shardwire:ready"] == 1
    assert 'shardwire:requests_total{outcome="served"} 2.0' in text


# -- server settings, keys, CORS ----------------------------------------------------------------


def test_server_defaults_and_n_predict_default(engine):
    settings = ServerSettings(sampling={"temperature": 0.0, "seed": 7}, n_predict=3)
    app = AppThread(engine, settings)
    try:
        native = call(app.url, "/completion", {"prompt": PROMPT})[1]
        assert native["tokens_predicted"] == 3 and native["generation_settings"]["seed"] == 7
        assert native["generation_settings"]["temperature"] == 0
        own = {"prompt": PROMPT, "n_predict": 5, "ignore_eos": True}
        assert call(app.url, "/completion", own)[1]["tokens_predicted"] == 5  # a request's own length wins
        openai_style = call(app.url, "/v1/completions", {"prompt": PROMPT})[1]
        assert openai_style["usage"]["completion_tokens"] == 3
        chat = call(app.url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 9})
        assert chat[1]["usage"]["completion_tokens"] <= 9
        ids = engine.tokenizer.encode(PROMPT, add_special=True, parse_special=True)
        assert openai_style["choices"][0]["text"] == greedy(engine, ids, 3)[0]  # --temp 0 applies to /v1 too
        props = call(app.url, "/props")[1]["default_generation_settings"]["params"]
        assert props["n_predict"] == 3 and props["seed"] == 7 and props["temperature"] == 0
    finally:
        app.stop()


def test_api_key_by_either_header_and_cors_origins(engine):
    app = AppThread(engine, api_key="k", cors=CorsPolicy(("http://ok.example", "localhost")))
    try:
        code, body, _ = call(app.url, "/props")
        assert code == 401 and body["error"]["type"] == "authentication_error"  # llama-server's type
        assert call(app.url, "/props", headers={"X-Api-Key": "k"})[0] == 200
        assert call(app.url, "/props", headers={"Authorization": "Bearer k"})[0] == 200
        assert call(app.url, "/props", headers={"X-Api-Key": "wrong"})[0] == 401
        assert call(app.url, "/health")[0] == 200

        def preflight(origin):
            req = urllib.request.Request(
                app.url + "/completion",
                method="OPTIONS",
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "x-api-key, content-type",
                },
            )
            with urllib.request.urlopen(req, timeout=30) as r:  # answered without the key
                return r.status, r.headers

        code, headers = preflight("http://ok.example")
        assert code == 200 and headers["Access-Control-Allow-Origin"] == "http://ok.example"
        assert headers["Access-Control-Allow-Methods"] == "GET, POST, DELETE, OPTIONS"  # llama-server's answer
        assert headers["Access-Control-Allow-Credentials"] == "true"
        assert headers["Access-Control-Allow-Headers"] == "x-api-key, content-type"  # "*" would not cover them
        for local in ("http://localhost:8080", "http://127.0.0.1", "http://[::1]:3000"):
            assert preflight(local)[1]["Access-Control-Allow-Origin"] == local
        for other in ("http://evil.example", "http://localhost.evil.example", "http://notlocalhost", "not a url"):
            code, headers = preflight(other)  # as llama-server: 200, but no origin the browser would accept
            assert code == 200 and "Access-Control-Allow-Origin" not in headers
        code, _, headers = call(app.url, "/props", headers={"X-Api-Key": "k", "Origin": "http://ok.example"})
        assert code == 200 and headers["Access-Control-Allow-Origin"] == "http://ok.example"
        code, _, headers = call(app.url, "/props", headers={"X-Api-Key": "k", "Origin": "http://evil.example"})
        assert "Access-Control-Allow-Origin" not in headers
    finally:
        app.stop()


def test_cors_policy_as_llama_server_answers():
    anyone = CorsPolicy()
    assert anyone.allowed_origin("https://ui.example") == "https://ui.example"  # reflected: credentials allowed
    assert anyone.allowed_origin(None) == "*"
    assert CorsPolicy(credentials=False).allowed_origin("https://ui.example") == "*"
    local = CorsPolicy(("localhost",))
    assert local.allowed_origin("http://127.0.0.1:5173") == "http://127.0.0.1:5173"
    assert local.allowed_origin("http://[::1") is None  # unparseable
    assert local.allowed_origin(None) is None


# -- `shardwire serve` and its flags -------------------------------------------------------------


def serve(model, *flags: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "shardwire", "serve", str(model), "--port", "0", "-c", str(CTX), "-np", "1"]
    cmd += ["--threads", "1", "--dtype", "float32", *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)


@pytest.mark.slow
def test_serve_flags(model, tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text(BUILTIN["llama3"])
    proc = serve(
        model,
        *("--temp", "0", "--seed", "7", "-n", "4", "--chat-template-file", str(template), "--jinja"),
        *("--metrics", "--cors-origins", "http://ok.example", "--api-key", "k", "--no-slots"),
    )
    log = []
    try:
        for line in proc.stdout:
            log.append(line)
            if m := re.search(r"ready: .* at (http://\S+)/v1", line):
                url = m[1]
                break
        else:
            raise AssertionError("serve did not get ready:\n" + "".join(log))
        key = {"X-Api-Key": "k"}
        body = call(url, "/completion", {"prompt": PROMPT}, key)[1]
        assert body["tokens_predicted"] == 4 and body["generation_settings"]["temperature"] == 0
        assert body["generation_settings"]["seed"] == 7
        assert call(url, "/v1/completions", {"prompt": PROMPT}, key)[1]["usage"]["completion_tokens"] == 4
        prompt = call(url, "/apply-template", {"messages": [{"role": "user", "content": "Hi"}]}, key)[1]["prompt"]
        assert prompt.endswith(
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        )
        props = call(url, "/props", None, key)[1]
        assert props["chat_template"] == BUILTIN["llama3"] and props["model_path"] == str(model)
        code, text, _ = call(url, "/metrics", None, key, raw=True)
        assert code == 200 and "llamacpp:tokens_predicted_total 8.0" in text
        assert call(url, "/slots", None, key)[0] == 501
        code, _, headers = call(url, "/props", None, {**key, "Origin": "http://ok.example"})
        assert headers["Access-Control-Allow-Origin"] == "http://ok.example"
    finally:
        proc.send_signal(2)
        proc.wait(30)


def test_serve_refuses_an_unknown_chat_template(model):
    proc = serve(model, "--chat-template", "no-such-template")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "no built-in template named 'no-such-template'" in out and "llama3" in out


def test_verbose_answers_carry_the_prompt_as_text(engine):
    chat = {"messages": [{"role": "user", "content": "What is the best book"}], "max_tokens": 2}
    for settings, asked, shown in [
        (ServerSettings(), {}, False),
        (ServerSettings(), {"verbose": True}, True),
        (ServerSettings(verbose=True), {}, True),  # serve --verbose
        (ServerSettings(verbose=True), {"verbose": False}, False),
    ]:
        app = AppThread(engine, settings)
        try:
            code, body, _ = call(app.url, "/v1/chat/completions", {**chat, **asked})
        finally:
            app.stop()
        assert code == 200 and ("__verbose" in body) == shown
        if shown:
            assert "What is the best book" in body["__verbose"]["prompt"]
            assert (
                body["__verbose"]["tokens_predicted"] == 2
                and body["__verbose"]["content"] == body["choices"][0]["message"]["content"]
            )


def test_apply_template_continues_a_last_assistant_message(server):
    asked = [{"role": "user", "content": "Hi"}]
    code, fresh, _ = call(server.url, "/apply-template", {"messages": asked})
    code2, prefill, _ = call(
        server.url, "/apply-template", {"messages": asked + [{"role": "assistant", "content": "Sure,"}]}
    )
    assert code == code2 == 200 and prefill["prompt"] == fresh["prompt"] + "Sure,"
    both = {"messages": asked, "continue_final_message": True}
    assert call(server.url, "/apply-template", both)[0] == 400
