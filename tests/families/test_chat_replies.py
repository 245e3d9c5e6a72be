"""Chat through `serve` as a real model of each family replies: a tiny model of the family, taught
to answer one request by thinking and then calling a tool in its own format (shardwire_kit.convert.
teach), converted by llama.cpp's converter. shardwire returns its reasoning apart and its call as a
call, the special tokens that mark them shown to the parsers as llama-server shows its preserved
tokens; and where llama.cpp is built, llama-server's answer to the same file and request is the
same message."""

import asyncio
import json
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from benchmarks.run import free_port
from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage

pytest.importorskip("transformers")
from taught import CALL, REASONING, REPLIES, asked  # noqa: E402  (needs transformers)

pytestmark = pytest.mark.slow  # a model taught, converted and served per family

# where the pinned llama-server cannot read the family's reply, and what it answers instead
UNREAD_BY_LLAMA_SERVER = {
    "deepseek2": "llama-server 0.3.36 answers R1's reply with a 500 (\"The model produced output that does not "
    "match the expected peg-native format\"): its /completion shows the reply with R1's call marks dropped "
    "(CONTROL tokens, as llama.cpp's converter types every <｜...｜> token)",
}


@pytest.fixture(scope="module", params=sorted(REPLIES))
def taught(request, taught_models) -> Path:
    return taught_models(request.param)


def _message(choice: dict) -> dict:
    """What a reply says, as both servers may spell it: no content is "" or null, arguments are JSON."""
    message = choice["message"]
    calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls") or []]
    return {
        "finish_reason": choice["finish_reason"],
        "content": message.get("content") or "",
        "reasoning_content": message.get("reasoning_content"),
        "tool_calls": calls,
    }


def _streamed(chunks: list[dict]) -> dict:
    """A streamed reply's deltas put together, as _message reads a whole one."""
    message, calls, finish = {"content": "", "reasoning_content": ""}, {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            for field in message:
                message[field] += delta.get(field) or ""
            for call in delta.get("tool_calls") or []:
                whole = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                for part, text in (call.get("function") or {}).items():
                    whole[part] += text or ""
            finish = choice.get("finish_reason") or finish
    message["tool_calls"] = [{"function": calls[i]} for i in sorted(calls)]
    return _message({"message": message, "finish_reason": finish})


async def _replies(url: str) -> tuple[dict, dict]:
    """The server's answer to ASKED, whole and streamed."""
    from aiohttp import ClientSession

    async with ClientSession() as http:
        async with http.post(f"{url}/v1/chat/completions", json=asked()) as r:
            assert r.status == 200, await r.text()
            whole = _message((await r.json())["choices"][0])
        async with http.post(f"{url}/v1/chat/completions", json={**asked(), "stream": True}) as r:
            assert r.status == 200, await r.text()
            lines = [line.decode().strip() async for line in r.content]
    events = [json.loads(line[len("data: ") :]) for line in lines if line.startswith("data: {")]
    return whole, _streamed(events)


EXPECTED = {"finish_reason": "tool_calls", "content": "", "reasoning_content": REASONING, "tool_calls": [CALL]}


def _shardwire_replies(path: Path) -> tuple[dict, dict]:
    from shardwire.tokenizer import load_tokenizer

    from served import served

    model = open_model(path)

    async def ask():
        stage = load_stage(model, 0, model.config.n_layers)
        async with served(stage, load_tokenizer(model)) as url:
            return await _replies(url)

    return asyncio.run(ask())


def test_serve_returns_the_reasoning_apart_and_the_call_as_a_call_whole_and_streamed(taught):
    assert _shardwire_replies(taught) == (EXPECTED, EXPECTED)


def _llama_server_replies(path: Path, server: Path) -> tuple[dict, dict]:
    port = free_port()
    proc = subprocess.Popen(
        [str(server), "-m", str(path), "--jinja", "-c", "1024", "-t", "1", "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError("llama-server did not start:\n" + proc.stderr.read()[-2000:]) from None
                time.sleep(0.2)
        return asyncio.run(_replies(f"http://127.0.0.1:{port}"))
    finally:
        proc.terminate()
        proc.wait(10)


def test_llama_server_returns_the_same_message_for_the_same_file_and_request(taught):
    from benchmarks.packed_models import LLAMA_CPP

    server = LLAMA_CPP / "bin" / "llama-server"
    if taught.stem in UNREAD_BY_LLAMA_SERVER:
        pytest.skip(UNREAD_BY_LLAMA_SERVER[taught.stem])
    if not server.is_file():
        pytest.skip(f"llama.cpp's llama-server is not built in {LLAMA_CPP} (benchmarks/build_llama_cpp.sh)")
    theirs = _llama_server_replies(taught, server)
    assert theirs == (EXPECTED, EXPECTED)
    assert _shardwire_replies(taught) == theirs
