"""The web page at /, against a real `shardwire serve` over two real workers on loopback: how it
is served (without the API key, cached by content hash, --no-webui), the cluster feed, and, in
headless Chromium, a chat streamed, stopped, exported and imported, and the cluster view watching
a worker die and the ring recover."""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest

from browser import SCREENSHOTS
from models import model_path
from serve_process import KEY, ServeProcess, call

pytestmark = pytest.mark.slow  # a server and two workers

LOAD_BUDGET_MS = 1000  # the page loads in under a second from the machine that serves it


@pytest.fixture(scope="module")
def server(two_workers, tmp_path_factory):
    # the qwen2 vocabulary brings Qwen's chat template; a worker lost is given up on after 20 s
    serve = ServeProcess(model_path("qwen2", "F32"), two_workers, tmp_path_factory.mktemp("coordinator"))
    yield serve
    serve.stop()


def get(url: str, headers: dict | None = None) -> tuple[int, dict, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


# -- how the page is served ----------------------------------------------------------------------


def test_the_page_and_its_files_need_no_key_and_are_cached_by_content(server):
    status, headers, body = get(server.url + "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert page.lower().startswith("<!doctype html>")  # what llama.cpp's own server tests look for
    assert headers["Cache-Control"] == "no-cache" and "default-src 'self'" in headers["Content-Security-Policy"]
    assert get(server.url + "/", {"If-None-Match": headers["ETag"]})[0] == 304

    files = re.findall(r'(?:src|href)="(/webui/[^"]+)"', page)
    assert {f.split("?")[0] for f in files} >= {"/webui/app.js", "/webui/app.css"}
    for f in files:
        status, headers, body = get(server.url + f, {"Accept-Encoding": "gzip"})
        assert status == 200 and body, f
        assert headers["Cache-Control"] == "public, max-age=31536000, immutable", f
        assert headers.get("Content-Encoding") == "gzip", f
    # without the content's hash, or with an old one, the browser must ask again
    assert get(server.url + "/webui/app.js")[1]["Cache-Control"] == "no-cache"
    assert get(server.url + "/webui/app.js?v=0123")[1]["Cache-Control"] == "no-cache"
    assert get(server.url + "/webui/nothing.js")[0] == 404
    assert get(server.url + "/webui/../cli/main.py")[0] == 404
    # the API still wants the key
    assert get(server.url + "/v1/cluster")[0] == 401
    assert get(server.url + "/v1/cluster/events")[0] == 401


def test_no_webui_answers_404(tmp_path):
    serve = ServeProcess(model_path("qwen2", "F32"), [], tmp_path, "--no-webui")
    try:
        assert get(serve.url + "/")[0] == 404
        assert get(serve.url + "/webui/app.js")[0] == 404
    finally:
        assert serve.stop() == 0


def test_the_cluster_feed_pushes_snapshots_as_they_change(server):
    request = urllib.request.Request(server.url + "/v1/cluster/events", headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(request, timeout=30) as r:
        assert r.headers["Content-Type"] == "text/event-stream"
        first = next_snapshot(r)
        workers = first["cluster"]["workers"]
        assert [w["state"] for w in workers] == ["healthy", "healthy"]
        assert all(s["weights"] and s["formats"] for w in workers for s in w["stages"])
        assert set(first["live"]) == {"tokens_per_s", "prompt_tokens_per_s", "step_ms", "running", "waiting"}

        # a request decoding: the feed shows it running, the rate it goes at, each stage's step
        generating = threading.Thread(
            target=call, args=(server.url, "/v1/completions", {"prompt": "Once", "max_tokens": 120, "ignore_eos": True})
        )
        generating.start()
        live = []
        while generating.is_alive() and len(live) < 200:
            live.append(next_snapshot(r)["live"])
            if live[-1]["running"] == 1 and live[-1]["tokens_per_s"] > 0:
                break
        assert live[-1]["running"] == 1 and live[-1]["tokens_per_s"] > 0, live
        generating.join()
    wait_until(
        lambda: all(
            st["step_ms"] for w in call_json(server, "/v1/cluster")["cluster"]["workers"] for st in w["stages"]
        ),
        "a stage's step time never came",
    )


def next_snapshot(stream) -> dict:
    """The next `cluster` event of a feed, past keep-alive comments."""
    while (line := stream.readline()) != b"event: cluster\n":
        assert line, "the feed ended"
    return json.loads(stream.readline().removeprefix(b"data: "))


# -- in the browser ------------------------------------------------------------------------------


def open_page(page, url: str, view: str = "chat"):
    page.goto(f"{url}/#{view}")
    dialog = page.get_by_test_id("api-key-dialog")
    dialog.wait_for(state="visible", timeout=10_000)  # the server has a key: the page asks for it
    page.get_by_test_id("api-key-input").fill(KEY)
    page.get_by_test_id("api-key-save").click()
    dialog.wait_for(state="hidden", timeout=10_000)


def send(page, text: str):
    page.get_by_test_id("prompt").fill(text)
    page.get_by_test_id("send").click()


def replies(page):
    return page.locator('[data-testid="message"][data-role="assistant"]')


def test_page_loads_within_a_second(server, page):
    page.goto(server.url + "/")
    timing = page.evaluate("JSON.stringify(performance.getEntriesByType('navigation')[0])")
    load_ms = json.loads(timing)["loadEventEnd"]
    assert 0 < load_ms < LOAD_BUDGET_MS, f"the page took {load_ms:.0f} ms to load"


def test_chat_streams_stops_exports_and_imports(server, page, tmp_path):
    open_page(page, server.url)
    settings = page.get_by_test_id("settings")
    settings.locator("summary").click()
    page.get_by_test_id("setting-max_tokens").fill("12")
    page.get_by_test_id("setting-temperature").fill("0")

    send(page, "Hello there")
    reply = replies(page).first
    stats = reply.get_by_test_id("stats")
    stats.wait_for(timeout=60_000)
    assert reply.get_by_test_id("message-content").inner_text().strip()
    assert re.search(r"TTFT \d+ ms", stats.inner_text()) and "tokens/s" in stats.inner_text()
    assert re.search(r"prompt \d+ tokens in \d+ ms", stats.inner_text())

    # regenerated; then the question edited, which asks again and drops the old reply
    page.get_by_test_id("regenerate").click()
    page.get_by_test_id("stop").wait_for(state="detached", timeout=60_000)
    replies(page).first.get_by_test_id("stats").wait_for(timeout=60_000)
    assert page.get_by_test_id("message").count() == 2
    page.get_by_test_id("edit").click()
    page.get_by_test_id("edit-text").fill("Hello again")
    page.get_by_test_id("edit-save").click()
    page.get_by_test_id("stop").wait_for(state="detached", timeout=60_000)
    replies(page).first.get_by_test_id("stats").wait_for(timeout=60_000)
    messages = page.get_by_test_id("message")
    assert messages.count() == 2 and messages.first.get_by_test_id("message-content").inner_text() == "Hello again"

    # a long reply, stopped as soon as it streams
    page.get_by_test_id("setting-max_tokens").fill("200")
    send(page, "Tell me a long story")
    page.get_by_test_id("stop").wait_for(timeout=30_000)
    second = replies(page).nth(1)
    page.wait_for_function(
        "() => document.querySelectorAll('[data-role=assistant]')[1]?.innerText.trim().length > 0", timeout=30_000
    )
    page.get_by_test_id("stop").click()
    assert "stopped" in second.get_by_test_id("stats").inner_text(timeout=10_000)
    page.get_by_test_id("send").wait_for(timeout=10_000)
    assert page.get_by_test_id("message").count() == 4
    wait_until(lambda: call_json(server, "/v1/cluster")["slots"]["busy"] == 0, "the stopped request still runs")

    # exported, deleted from the browser, imported back whole
    with page.expect_download() as download:
        page.get_by_test_id("export").click()
    exported = tmp_path / "conversation.json"
    download.value.save_as(exported)
    conversation = json.loads(exported.read_text())
    assert [m["role"] for m in conversation["messages"]] == ["user", "assistant", "user", "assistant"]
    page.get_by_test_id("new-chat").click()
    assert page.locator('[data-testid="message"]').count() == 0
    page.get_by_test_id("import-file").set_input_files(str(exported))
    page.wait_for_function("() => document.querySelectorAll('[data-testid=message]').length === 4")
    restored = page.get_by_test_id("message").nth(2).get_by_test_id("message-content")
    assert restored.inner_text().strip() == "Tell me a long story"

    # a file that is not a conversation: a clear error, nothing lost
    bad = tmp_path / "bad.json"
    bad.write_text('{"messages": 3}')
    page.get_by_test_id("import-file").set_input_files(str(bad))
    page.get_by_test_id("error").wait_for(timeout=5_000)
    assert page.locator('[data-testid="message"]').count() == 4

    # a schema that is not JSON: said so, nothing sent
    page.get_by_test_id("setting-schema").fill("{not json")
    send(page, "Answer in JSON")
    page.get_by_text('Setting "JSON schema" is not JSON').wait_for(timeout=5_000)
    assert page.locator('[data-testid="message"]').count() == 4
    assert not page.errors


def test_reasoning_folds_and_a_tool_call_shows(page, taught_models, tmp_path):
    """A model taught to think and then call a tool, asked as the page asks it, with the tool in
    the settings: its reasoning folded above the reply, its call as a call."""
    pytest.importorskip("transformers")
    from taught import ASKED, CALL, REASONING
    from tool_calls import WEATHER

    model = taught_models("glm4moe")
    serve = ServeProcess(model, [], tmp_path / "coordinator", "-c", "1024")
    try:
        open_page(page, serve.url)
        page.get_by_test_id("settings").locator("summary").click()
        page.get_by_test_id("setting-max_tokens").fill(str(ASKED["max_tokens"]))
        page.get_by_test_id("setting-temperature").fill("0")
        page.get_by_test_id("setting-tools").fill(json.dumps([WEATHER]))
        send(page, ASKED["messages"][0]["content"])
        reply = replies(page).first
        reply.get_by_test_id("stats").wait_for(timeout=60_000)
        reasoning = reply.get_by_test_id("reasoning")
        assert reasoning.get_attribute("open") is None  # folded
        assert reasoning.text_content().strip() == "Reasoning" + REASONING
        call = reply.get_by_test_id("tool-call")
        name, arguments = CALL
        assert name in call.inner_text() and json.loads(call.locator("pre").inner_text()) == arguments
        assert not page.errors
    finally:
        assert serve.stop() == 0


def test_cluster_view_shows_a_worker_lost_the_ring_recovering_and_the_worker_rejoining(server, two_workers, page):
    workers = two_workers
    open_page(page, server.url, "cluster")
    cards = page.get_by_test_id("worker")
    page.wait_for_function("() => document.querySelectorAll('[data-testid=worker][data-state=healthy]').length === 2")
    assert cards.count() == 2
    assert page.get_by_test_id("ring").is_visible()
    names = [cards.nth(i).get_attribute("data-name") for i in range(2)]
    assert sorted(names) == sorted(w.address for w in workers)

    workers[1].kill()
    lost = page.locator(f'[data-testid="worker"][data-name="{workers[1].address}"][data-state="lost"]')
    lost.wait_for(timeout=30_000)
    page.wait_for_function(
        "name => document.querySelector(`[data-testid=worker][data-name='${name}']`)?.dataset.state === 'healthy'",
        arg=workers[0].address,
        timeout=60_000,
    )
    page.get_by_test_id("recovery").filter(has_text="recovered").first.wait_for(timeout=10_000)
    status = call_json(server, "/v1/cluster")
    assert status["ready"]
    (held,) = [w["stages"] for w in status["cluster"]["workers"] if w["name"] == workers[0].address]
    start, end = held[0]["blocks"][0], held[-1]["blocks"][1]
    assert (start, end) == (0, 4)  # every block, on the worker left
    shown = [f"blocks {a}\u2013{b - 1}" for a, b in (st["blocks"] for st in held)]
    page.wait_for_function(
        "([name, texts]) => texts.every(t => document.querySelector(`[data-testid=worker][data-name='${name}']`)"
        ".innerText.includes(t))",
        arg=[workers[0].address, shown],
        timeout=10_000,
    )
    page.get_by_test_id("stat-mode").get_by_text("1 worker (+1 without a stage)").wait_for(timeout=10_000)
    page.screenshot(path=str(SCREENSHOTS / "cluster-after-recovery.png"), full_page=True)

    # the worker back at its address: the plan moves stages back onto it, and the page says so
    workers[1] = workers[1].restarted()
    back = page.locator(f'[data-testid="worker"][data-name="{workers[1].address}"][data-state="rejoined"]')
    back.wait_for(timeout=60_000)
    page.get_by_test_id("stat-mode").get_by_text("2 workers").wait_for(timeout=10_000)
    assert not page.errors


def call_json(server, path: str) -> dict:
    return json.loads(get(server.url + path, {"Authorization": f"Bearer {KEY}"})[2])


def wait_until(condition, message: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, message
        time.sleep(0.1)
