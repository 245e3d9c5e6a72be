"""`shardwire serve` as a real process over two real workers, driven by the official openai client."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytestmark = pytest.mark.slow  # worker processes

openai = pytest.importorskip("openai")

from shardwire.engine import Engine, Request  # noqa: E402
from shardwire.formats import open_model  # noqa: E402
from shardwire.pipeline import LocalPipeline, PipelineError  # noqa: E402
from shardwire.pipeline.loading import load_stage  # noqa: E402
from shardwire.sampling import SamplingParams  # noqa: E402
from shardwire.tokenizer import load_tokenizer  # noqa: E402
from shardwire.weights.measure import fastest_formats  # noqa: E402
from shardwire.weights.policy import default_dtype  # noqa: E402

from models import model_path  # noqa: E402
from serve_process import CTX, KEY, PARALLEL, ServeProcess, call  # noqa: E402
from tool_calls import QWEN25_TEMPLATE, WEATHER  # noqa: E402
from workers import WorkerProcess  # noqa: E402

PROMPTS = [
    "Once upon a time",
    "The clockmaker opened her shop",
    "def add(a, b):",
    "Children asked why gears turn",
    "In the evening the river",
    "tick, tock",
    "Time is patient",
    "12 or 13 broken clocks",
]


@pytest.fixture(scope="module")
def model():
    return model_path("qwen2", "F32")  # the qwen2 vocabulary brings Qwen's chat template


@pytest.fixture(scope="module")
def server(model, two_workers, tmp_path_factory):
    serve = ServeProcess(model, two_workers, tmp_path_factory.mktemp("coordinator"))
    yield serve
    code = serve.stop()
    print("".join(serve.log))  # pytest shows it when the teardown fails
    assert code == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference(model):
    """The same model in this process, one request at a time: what the server must produce."""
    m = open_model(model)
    tokenizer = load_tokenizer(m)
    # the kernels the workers measured fastest here: seeded sampling over the whole vocabulary
    # follows the last bits of the logits
    stage = load_stage(m, 0, m.config.n_layers, weights="fast", fastest=fastest_formats("cpu", default_dtype("cpu")))
    engine = Engine(LocalPipeline([stage], n_slots=1, ctx=CTX), tokenizer)

    def run(prompt: list[int], n: int, sampling=SamplingParams(temperature=0.0)) -> str:
        return engine.submit(Request(prompt, sampling, max_tokens=n)).result()

    run.tokenizer = tokenizer
    yield run
    engine.close()


def status(server) -> dict:
    return call(server.url, "/v1/cluster")[1]


def test_completion_chat_and_streamed_chat_through_the_openai_client(client, model, reference):
    tok = reference.tokenizer
    done = client.completions.create(model=model.name, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert done.choices[0].text == reference(tok.encode(PROMPTS[0]), 10)
    assert done.usage.prompt_tokens == len(tok.encode(PROMPTS[0]))
    assert done.usage.completion_tokens <= 10 and done.choices[0].finish_reason in ("stop", "length")

    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a clock part."}]
    chat = client.chat.completions.create(
        model=model.name, messages=messages, max_tokens=12, temperature=0.9, seed=1234
    )
    text = chat.choices[0].message.content
    prompt = tok.encode(tok.apply_chat_template(messages), add_special=False, parse_special=True)
    assert "<|im_start|>" in tok.apply_chat_template(messages)  # Qwen's template from the model file
    assert chat.usage.prompt_tokens == len(prompt)
    # OpenAI's defaults: temperature as given, top_p 1, top_k and min_p off
    assert text == reference(prompt, 12, SamplingParams(temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234))

    stream = client.chat.completions.create(
        model=model.name,
        messages=messages,
        max_tokens=12,
        temperature=0.9,
        seed=1234,
        stream=True,
        stream_options={"include_usage": True},
        # computed afresh as the first was: a reused prefix (float16 keys from other chunk shapes)
        # may round a near-tie of this random model the other way
        extra_body={"cache_prompt": False},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == chat.choices[0].finish_reason


def test_a_tool_call_round_trip_through_the_openai_client(model, tmp_path):
    """A served model with a tool-capable template (Qwen2.5's, --chat-template-file) on 2 workers:
    tools in the request, a named tool_choice (the constraint makes the random model's call
    valid), tool_calls in the answer; the call and its result go back in the next request,
    through the template, and the model answers."""
    template = tmp_path / "qwen25.jinja"
    template.write_text(QWEN25_TEMPLATE)
    workers = [WorkerProcess(tmp_path / f"worker{i}").start() for i in range(2)]
    serve = ServeProcess(model, workers, tmp_path / "coordinator", "--chat-template-file", str(template), "--jinja")
    try:
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
        _tool_call_round_trip(client, model)
    finally:
        assert serve.stop() == 0
        for w in workers:
            w.stop()


def _tool_call_round_trip(client, model) -> None:
    messages = [{"role": "user", "content": "What is the weather in Rome?"}]
    forced = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=model.name,
        messages=messages,
        tools=[WEATHER],
        tool_choice=forced,
        parallel_tool_calls=False,
        max_tokens=200,
        seed=1,
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")

    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21C"},
    ]
    second = client.chat.completions.create(
        model=model.name, messages=messages, tools=[WEATHER], max_tokens=8, seed=1, extra_body={"verbose": True}
    )
    prompt = second.model_extra["__verbose"]["prompt"]  # llama-server's field: the prompt as text
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt  # the tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": ' in prompt  # the model's call
    assert "<tool_response>\nsunny, 21C\n</tool_response>" in prompt  # its result
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_n_choices_logprobs_and_stop(client, model):
    out = client.chat.completions.create(
        model=model.name,
        messages=[{"role": "user", "content": "Hi"}],
        n=3,
        max_tokens=6,
        temperature=1.0,
        seed=5,
        logprobs=True,
        top_logprobs=2,
    )
    assert [c.index for c in out.choices] == [0, 1, 2]
    first = client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=1.0, seed=5
    )
    assert out.choices[0].message.content == first.choices[0].message.content  # choice j draws with seed + j
    for entry in out.choices[0].logprobs.content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2

    full = client.completions.create(model=model.name, prompt=PROMPTS[1], max_tokens=12, temperature=0).choices[0].text
    cut = full[len(full) // 2 :][:3]
    assert cut.strip()
    stopped = client.completions.create(model=model.name, prompt=PROMPTS[1], max_tokens=12, temperature=0, stop=[cut])
    assert stopped.choices[0].text == full[: full.index(cut)] and stopped.choices[0].finish_reason == "stop"


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, client, model):
    url = server.url
    cases = [
        (call(url, "/v1/chat/completions", b'{"messages": [oops'), 400, None),
        (call(url, "/v1/chat/completions", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"), 400, None),
        (call(url, "/v1/completions", b'{"prompt": "hi", "stop": ' + b"[" * 200 + b"]" * 200 + b"}"), 400, None),
        (call(url, "/v1/models/no-such-model"), 404, "model_not_found"),
        (call(url, "/v1/completions", {"model": 7, "prompt": "hi"}), 400, None),
        (call(url, "/detokenize", {"tokens": [10**9]}), 400, None),
        (call(url, "/tokenize", {"content": 5}), 400, None),
        (call(url, "/v1/completions", {"prompt": "hi", "max_tokens": -1}), 400, None),
        (call(url, "/v1/completions", {"prompt": "tick tock " * 200}), 400, "context_length_exceeded"),
        (call(url, "/v1/chat/completions", {"messages": "hi"}), 400, None),
        (call(url, "/v1/completions", {"prompt": "hi", "temperature": "hot"}), 400, None),
        (call(url, "/v1/completions", {"prompt": [10**9]}), 400, None),
        (call(url, "/v1/completions", {"prompt": "hi"}, key="wrong"), 401, "invalid_api_key"),
        (call(url, "/v1/models", key=None), 401, "invalid_api_key"),
        (call(url, "/v1/nowhere"), 404, None),
    ]
    for (status_code, body), expected, code in cases:
        assert status_code == expected, body
        assert {"message", "type", "param", "code"} <= set(body["error"]) and body["error"]["message"]
        if code:
            assert body["error"]["code"] == code
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model.name, prompt="hi", max_tokens=-5)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
    assert call(url, "/health", key=None) == (200, {"status": "ok"})  # no key needed, like llama-server
    assert [m.id for m in client.models.list()] == [model.name]
    assert client.completions.create(model=model.name, prompt="hi", max_tokens=3).usage.completion_tokens >= 1


def test_llama_server_clients_find_what_they_call(server, client, model):
    """Any model name (a client's default), /models, /v1/health, /tokenize, /detokenize, and CORS
    for a browser page: a preflight without the key, then the key on the real request."""
    url = server.url
    asked = client.completions.create(model="gpt-3.5-turbo", prompt="Once upon a time", max_tokens=4, temperature=0)
    served = client.completions.create(model=model.name, prompt="Once upon a time", max_tokens=4, temperature=0)
    assert asked.choices[0].text == served.choices[0].text
    assert [m["id"] for m in call(url, "/models")[1]["data"]] == [model.name]
    assert call(url, "/v1/health", key=None) == (200, {"status": "ok"})
    tokens = call(url, "/tokenize", {"content": "Once upon a time"})[1]["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    assert call(url, "/detokenize", {"tokens": tokens}) == (200, {"content": "Once upon a time"})
    pieces = call(url, "/tokenize", {"content": "Once upon", "with_pieces": True})[1]["tokens"]
    assert "".join(p["piece"] for p in pieces).replace("\u0120", " ") == "Once upon"

    preflight = urllib.request.Request(
        url + "/v1/chat/completions",
        method="OPTIONS",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    with urllib.request.urlopen(preflight, timeout=30) as r:  # any origin by default, as llama-server
        assert r.status == 200 and r.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
        assert "POST" in r.headers["Access-Control-Allow-Methods"]
        assert "authorization" in r.headers["Access-Control-Allow-Headers"].lower()
    request = urllib.request.Request(url + "/v1/models", headers={"Origin": "http://localhost:3000"})
    with pytest.raises(urllib.error.HTTPError) as refused:  # the key is still required
        urllib.request.urlopen(request, timeout=30)
    assert refused.value.code == 401
    assert refused.value.headers["Access-Control-Allow-Origin"] == "http://localhost:3000"


def test_eight_concurrent_streams_match_the_same_requests_one_at_a_time(client, model):
    def one(i, stream):
        # top_k (llama-server's extra field) spares the sampler sorting all 151936 logits per token
        kw = dict(
            model=model.name,
            messages=[{"role": "user", "content": PROMPTS[i]}],
            max_tokens=12,
            temperature=0.8,
            seed=i,
            extra_body={"top_k": 40},
        )
        if not stream:
            return client.chat.completions.create(**kw).choices[0].message.content
        return "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))

    alone = [one(i, False) for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # twice the slots: four decode together, four queue
        together = list(pool.map(lambda i: one(i, True), range(len(PROMPTS))))
    assert together == alone
    assert all(alone) and len(set(alone)) == len(alone)


def test_client_disconnect_cancels_its_sequence_and_frees_the_slot(server, client, model):
    before = status(server)["requests"]["client_gone"]
    streams = [
        client.completions.create(model=model.name, prompt=p, max_tokens=CTX, temperature=0, stream=True)
        for p in PROMPTS[:PARALLEL]
    ]  # every slot busy for ~240 tokens
    for s in streams:
        next(iter(s))
    assert status(server)["slots"]["busy"] == PARALLEL
    for s in streams:
        s.close()
    deadline = time.monotonic() + 15
    while (st := status(server))["slots"]["busy"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert (st["slots"]["busy"], st["slots"]["waiting"], st["slots"]["kv"]["in_use"]) == (0, 0, 0)
    assert st["requests"]["client_gone"] == before + PARALLEL  # cancelled while still generating
    t = time.monotonic()
    assert client.completions.create(model=model.name, prompt="hi", max_tokens=4, temperature=0).choices[0].text
    assert time.monotonic() - t < 10  # served at once, not behind four long generations


def test_health_and_cluster_status(server):
    st = status(server)
    assert st["ready"] and st["ctx"] == CTX
    workers = st["cluster"]["workers"]
    assert [w["stages"][0]["blocks"] for w in workers] == [[0, 2], [2, 4]]
    for w in workers:
        assert w["alive"] and w["devices"][0]["name"] == "cpu" and w["devices"][0]["free"] > 0
        assert w["stages"][0]["weight_bytes"] > 0 and w["stages"][0]["kv_bytes"] > 0
    deadline = time.monotonic() + 5  # heartbeats measure latency once a second
    while any(w["latency_ms"] is None for w in status(server)["cluster"]["workers"]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(w["latency_ms"] is not None for w in status(server)["cluster"]["workers"])


def test_metrics_show_each_worker(server, client, model):
    """GET /metrics (--metrics): llama-server's counters, and per worker its heartbeat latency and
    the bytes on the coordinator's connection to it."""
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=model.name, prompt=PROMPTS[0], max_tokens=3, temperature=0)
    request = urllib.request.Request(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        families = {f.name: f for f in text_string_to_metric_families(r.read().decode())}
    names = [w["name"] for w in status(server)["cluster"]["workers"]]

    def per_worker(family: str) -> dict:
        return {s.labels["worker"]: s.value for s in families[family].samples if "worker" in s.labels}

    assert families["llamacpp:tokens_predicted"].samples[0].value >= 3
    assert sorted(per_worker("shardwire:worker_latency_seconds")) == sorted(names)
    assert per_worker("shardwire:worker_alive") == dict.fromkeys(names, 1.0)
    assert all(v > 0 for v in per_worker("shardwire:wire_sent_bytes").values())
    assert all(v > 0 for v in per_worker("shardwire:wire_received_bytes").values())
    assert "shardwire:recoveries" in families


def test_a_lost_worker_is_survived_then_readmitted_and_new_workers_join(server, two_workers, client, model, tmp_path):
    workers = two_workers
    victim = workers[1]
    victim.kill()
    # the model fits on the remaining worker: requests keep being served
    out = client.completions.create(model=model.name, prompt=PROMPTS[0], max_tokens=4, temperature=0)
    assert out.choices[0].text
    st = status(server)["cluster"]
    assert st["recoveries"] and victim.address in st["recoveries"][-1]["lost"]
    assert sum(bool(w["stages"]) for w in st["workers"]) == 1

    workers[1] = victim.restarted()  # back on the same address
    wait_for_stages(server, client, model, 2)

    newcomer = WorkerProcess(tmp_path / "new").start()
    try:
        code, body = call(server.url, "/v1/cluster/workers", {"address": newcomer.address})
        assert code == 200 and newcomer.address in body["workers"]
        wait_for_stages(server, client, model, 3)
        assert call(server.url, "/v1/cluster/workers", {"address": "not an address"})[0] == 400
    finally:
        newcomer.stop()
    server.wait_healthy(30)


def wait_for_stages(server, client, model, n, timeout=30):
    """Stages move onto returning or new workers at the next step boundary; keep the engine busy."""
    deadline = time.monotonic() + timeout
    while sum(bool(w["stages"]) for w in status(server)["cluster"]["workers"]) != n:
        assert time.monotonic() < deadline, status(server)
        client.completions.create(model=model.name, prompt=PROMPTS[1], max_tokens=2, temperature=0)
        time.sleep(0.3)


class _GonePipeline:
    """A pipeline whose worker has gone: every step fails."""

    n_slots, ctx, kv_pages, n_stages, vocab_size, broken = 2, 64, 8, 1, 151936, None
    stages_overlap = True

    def __init__(self):
        self.on_result = self.on_wake = lambda *args: None

    def submit(self, step):
        raise PipelineError("worker 10.0.0.9:50052 is gone (connection reset)", "10.0.0.9:50052")

    def free(self, slot):
        pass

    def idle(self):
        pass

    def status(self):
        return {"plan": "p", "ready": True, "broken": None, "workers": []}

    def close(self):
        pass


def test_generation_failing_on_a_gone_worker_is_503_and_the_server_stays_up(model):
    """The HTTP side of a failure (in process, over a pipeline that fails every step)."""
    from aiohttp import ClientSession, web

    from shardwire.serving.app import Backend, create_app

    async def scenario():
        backend = Backend("m", load_tokenizer(open_model(model)), set(), {})
        backend.attach(_GonePipeline(), None, Engine(_GonePipeline(), backend.tokenizer))
        runner = web.AppRunner(create_app(backend), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://%s:%d" % runner.addresses[0][:2]
        try:
            async with ClientSession() as http:
                for stream in (False, True, False):
                    async with http.post(
                        url + "/v1/chat/completions",
                        json={"messages": [{"role": "user", "content": "hi"}], "stream": stream},
                    ) as r:
                        assert r.status == 503
                        error = (await r.json())["error"]
                        assert error["type"] == "unavailable_error" and "10.0.0.9:50052" in error["message"]
                async with http.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": -1}) as r:
                    assert r.status == 400
        finally:
            backend.engine.close()
            await runner.cleanup()

    asyncio.run(scenario())
