"""OpenAI tool calls (shardwire/tools.py): tools reach the model's chat template, the history's
calls and tool results render through it, the model's calls are read back from its text, and a
forced tool_choice constrains the output to a valid call (end to end over HTTP, in process)."""

# ruff: noqa: E501  (the chat templates below are verbatim, long lines and all)
from __future__ import annotations

import asyncio
import json

import pytest

from shardwire.engine import Engine
from shardwire.formats import open_model
from shardwire.loading import load_stage
from shardwire.openai_api import APIError, Choice, parse_chat, response
from shardwire.pipeline import LocalPipeline
from shardwire.tokenizer import load_tokenizer
from shardwire.tools import ToolStream, parse_tool_calls

from models import model_path

# Qwen2.5-Instruct's chat template (tools in the system turn, Hermes-style <tool_call> blocks).
QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# The tool parts of Llama 3.1-Instruct's template: tools in the user turn, calls as bare JSON
# with "parameters", results under the ipython role.
LLAMA31_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message.role == 'user' and tools and loop.last %}
        {{- '<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": dictionary of argument name and its value}.Do not use variables.\\n\\n' }}
        {%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
        {{- message.content + '<|eot_id|>' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}{{- "<|eot_id|>" }}
    {%- elif message.role == 'tool' %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
    {%- else %}
        {{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim + '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
{#- <|python_tag|> #}
"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
NAMES = {"get_weather", "get_time"}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21C"},
]


@pytest.fixture(scope="module")
def qwen():
    tokenizer = load_tokenizer(open_model(model_path("qwen2", "F32")))
    tokenizer.chat_template = QWEN25_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def llama():
    tokenizer = load_tokenizer(open_model(model_path("qwen2", "F32")))
    tokenizer.chat_template = LLAMA31_TEMPLATE
    return tokenizer


def prompt_text(tokenizer, body) -> str:
    (prompt,) = parse_chat(body, tokenizer).prompts
    return tokenizer.decode(prompt, skip_special=False)


def test_tools_and_the_call_history_render_through_qwen_s_template(qwen):
    text = prompt_text(qwen, {"messages": HISTORY, "tools": [WEATHER, TIME]})
    assert "# Tools" in text and json.dumps(WEATHER, ensure_ascii=False) in text
    # OpenAI's arguments (JSON text) reach the template as an object, as the model wrote them
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert "<|im_start|>assistant\n" + call in text
    assert "<|im_start|>user\n<tool_response>\nsunny, 21C\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # tool_choice "none": the template never hears of the tools, and nothing is parsed as a call
    job = parse_chat({"messages": HISTORY, "tools": [WEATHER], "tool_choice": "none"}, qwen)
    assert job.tools is None and "# Tools" not in qwen.decode(job.prompts[0], skip_special=False)


def test_calls_written_as_qwen_s_template_writes_them_are_read_back(qwen):
    rendered = prompt_text(qwen, {"messages": HISTORY[:2]})
    turn = rendered.split("<|im_start|>assistant\n", 1)[1].split("<|im_end|>")[0]
    content, calls = parse_tool_calls(turn, NAMES)
    assert content is None and len(calls) == 1
    assert calls[0].name == "get_weather" and json.loads(calls[0].arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("call_")
    # text around calls is content; two calls are two calls; an unterminated last call still counts
    two = 'Let me check.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n' + turn.replace(
        "</tool_call>", ""
    )
    content, calls = parse_tool_calls(two, NAMES)
    assert content == "Let me check." and [c.name for c in calls] == ["get_time", "get_weather"]
    # not a call: an unknown function, broken JSON, no tag
    for text in (
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {</tool_call>',
        "The weather is fine.",
    ):
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_llama_3_json_calls_are_read_back(llama):
    text = prompt_text(llama, {"messages": HISTORY, "tools": [WEATHER]})
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert "<|start_header_id|>ipython<|end_header_id|>\n\nsunny, 21C" in text
    for out in (
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
        '  {"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n',
    ):
        content, calls = parse_tool_calls(out, NAMES)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Rome"})
        ]
    two = '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}'
    _, calls = parse_tool_calls(two, NAMES)
    assert [c.name for c in calls] == ["get_time", "get_weather"]
    assert parse_tool_calls('{"answer": 42}', NAMES) == ('{"answer": 42}', [])
    # the template writes "parameters": a forced call is constrained to that key
    job = parse_chat({"messages": HISTORY[:1], "tools": [WEATHER], "tool_choice": "required"}, llama)
    assert job.tools.arguments_key == "parameters" and job.grammar is not None


def test_streamed_text_is_held_back_only_where_a_call_may_begin():
    out = 'Sure.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    stream = ToolStream(NAMES)
    sent = "".join(stream.feed(ch) for ch in out)
    assert sent == "Sure.\n"  # never a piece of the tag
    rest, calls = stream.finish()
    assert rest == "" and [c.name for c in calls] == ["get_time"]
    stream = ToolStream(NAMES)
    assert "".join(stream.feed(ch) for ch in "a < b <tool") == "a < b "
    assert stream.feed("s are fine") == "<tools are fine" and stream.finish() == ("", [])
    stream = ToolStream(NAMES)  # a bare JSON call: nothing goes out before the end
    assert stream.feed(' {"name": "get_time", ') == "" and stream.feed('"parameters": {}}') == ""
    assert [c.name for c in stream.finish()[1]] == ["get_time"]
    stream = ToolStream(NAMES)  # JSON that is not a call comes out whole at the end
    assert stream.feed('{"a": 1}') == "" and stream.finish() == ('{"a": 1}', [])


def test_response_carries_tool_calls(qwen):
    job = parse_chat({"messages": HISTORY[:1], "tools": [WEATHER]}, qwen)
    c = Choice(0, qwen, frozenset())
    c.finish_reason = "stop"
    c.text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    (choice,) = response(job, "m", [c], {})["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}
    c.text = "No call here."
    (choice,) = response(job, "m", [c], {})["choices"]
    assert choice["message"]["content"] == "No call here." and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "fields, fragment, param",
    [
        ({"tools": {"name": "f"}}, "'tools' must be a list", "tools"),
        ({"tools": [{"type": "function", "function": {"description": "x"}}]}, "non-empty 'name'", "tools[0].function"),
        ({"tools": [{"type": "function"}]}, "non-empty 'name'", "tools[0].function"),
        ({"tools": [{"type": "retrieval"}]}, "of type 'function'", "tools[0]"),
        ({"tools": [WEATHER, WEATHER]}, "given twice", "tools[1]"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "'nope', which is not in 'tools'",
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "always"}, "'tool_choice' must be", "tool_choice"),
        ({"tool_choice": "required"}, "'tool_choice' needs 'tools'", "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "only one of",
            None,
        ),
    ],
)
def test_bad_tools_are_bad_requests(qwen, fields, fragment, param):
    with pytest.raises(APIError) as info:
        parse_chat({"messages": HISTORY[:1], **fields}, qwen)
    assert info.value.status == 400 and fragment in info.value.message, info.value.message
    if param is not None:
        assert info.value.param == param


def test_bad_call_history_is_a_bad_request(qwen):
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {}}]}]
    with pytest.raises(APIError, match=r"tool_calls\[0\] must have function.name"):
        parse_chat({"messages": messages}, qwen)


def test_a_forced_tool_choice_makes_the_model_call_it_over_http(qwen):
    """A random-weight model, in process behind the real HTTP app: a named tool_choice makes it
    write a valid call, returned as tool_calls whole and streamed."""
    from aiohttp import ClientSession, web

    from shardwire.server import Backend, create_app

    path = model_path("qwen2", "F32")
    m = open_model(path)

    async def scenario():
        backend = Backend("m", qwen, set(), {})
        pipeline = LocalPipeline([load_stage(m, 0, m.config.n_layers)], n_slots=2, ctx=512)
        backend.attach(pipeline, None, Engine(pipeline, qwen))
        runner = web.AppRunner(create_app(backend), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = "http://%s:%d/v1/chat/completions" % runner.addresses[0][:2]
        body = {
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": [TIME, WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 60,
            "seed": 1,
        }
        try:
            async with ClientSession() as http:
                async with http.post(url, json=body) as r:
                    assert r.status == 200, await r.text()
                    (choice,) = (await r.json())["choices"]
                assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
                (call,) = choice["message"]["tool_calls"]
                assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
                assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")

                async with http.post(url, json={**body, "stream": True}) as r:
                    assert r.status == 200
                    events = [
                        json.loads(line[6:])
                        for line in (await r.text()).splitlines()
                        if line.startswith("data: ") and line != "data: [DONE]"
                    ]
                deltas = [e["choices"][0]["delta"] for e in events]
                streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
                assert streamed == [[{**call, "index": 0, "id": streamed[0][0]["id"]}]]  # same call (seeded)
                assert not any(d.get("content") for d in deltas)
                assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

                # "auto" with a model that writes no call: plain content, finish "stop" or "length"
                auto = {**body, "tool_choice": "auto", "max_tokens": 8}
                async with http.post(url, json=auto) as r:
                    (choice,) = (await r.json())["choices"]
                assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["message"]["content"], str)
                async with http.post(url, json={**body, "tool_choice": {"type": "function"}}) as r:
                    assert r.status == 400 and (await r.json())["error"]["param"] == "tool_choice"
        finally:
            backend.engine.close()
            await runner.cleanup()

    asyncio.run(scenario())
