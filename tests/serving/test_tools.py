"""OpenAI tool calls (shardwire/tools.py): tools reach the model's chat template, the history's
calls and tool results render through it, the model's calls are read back from its text, and a
forced tool_choice constrains the output to a valid call (end to end over HTTP, in process)."""

# ruff: noqa: E501  (the chat templates below are verbatim, long lines and all)
from __future__ import annotations

import asyncio
import json

import pytest

from shardwire.formats import open_model
from shardwire.pipeline.loading import load_stage
from shardwire.serving.openai_api import APIError, Choice, chunk_choice, parse_chat, response, tool_stream
from shardwire.serving.tools import DEEPSEEK, GLM, KIMI, LLAMA3, MISTRAL, ToolStream, call_syntax, parse_tool_calls
from shardwire.tokenizer import load_tokenizer

from models import model_path
from tool_calls import QWEN25_TEMPLATE, WEATHER

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

# A Mistral-style template (as Mistral's v3 tokenizer templates lay a conversation out): tools
# before the last user turn, calls as [TOOL_CALLS] and a JSON list, results under [TOOL_RESULTS],
# and call ids that must be 9 letters or digits.
MISTRAL_TEMPLATE = """{{- bos_token }}
{%- set ns = namespace(last_user=-1) %}
{%- for message in messages %}
    {%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.index0 == ns.last_user %}
            {{- '[AVAILABLE_TOOLS]' + tools | tojson + '[/AVAILABLE_TOOLS]' }}
        {%- endif %}
        {{- '[INST]' + message.content + '[/INST]' }}
    {%- elif message.role == 'assistant' and message.tool_calls %}
        {{- '[TOOL_CALLS][' }}
        {%- for call in message.tool_calls %}
            {%- if call.id is not string or call.id | length != 9 or not call.id.isalnum() %}
                {{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}
            {%- endif %}
            {{- {'name': call.function.name, 'arguments': call.function.arguments, 'id': call.id} | tojson }}
            {%- if not loop.last %}{{- ', ' }}{%- endif %}
        {%- endfor %}
        {{- ']' + eos_token }}
    {%- elif message.role == 'assistant' %}
        {{- message.content + eos_token }}
    {%- elif message.role == 'tool' %}
        {{- '[TOOL_RESULTS]' + {'content': message.content, 'call_id': message.tool_call_id} | tojson + '[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}
"""

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


@pytest.fixture(scope="module")
def mistral():
    tokenizer = load_tokenizer(open_model(model_path("qwen2", "F32")))
    tokenizer.chat_template = MISTRAL_TEMPLATE
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


def names_and_args(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


TIME_AND_ROME = [("get_time", {}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize(
    "text",
    [
        # Qwen/Hermes: a block per call, or (as some models write them) several calls in one block
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
        # Llama 3.1/3.2: objects after one another, by ";" or newlines, <|python_tag|> or not
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": "Rome"}}',
        '{"name": "get_time", "parameters": {}}\n{"name": "get_weather", "parameters": {"city": "Rome"}}\n',
        '<|python_tag|>{"name": "get_time", "parameters": {}};<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}',
        # a JSON list of calls (what a forced choice with parallel calls writes)
        '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
    ],
)
def test_parallel_calls_are_each_a_call_with_its_own_id(text):
    content, calls = parse_tool_calls(text, NAMES)
    assert content is None and names_and_args(calls) == TIME_AND_ROME
    assert len({c.id for c in calls}) == 2
    content, calls = parse_tool_calls(text, NAMES, parallel=False)  # parallel_tool_calls false: the first only
    assert content is None and names_and_args(calls) == TIME_AND_ROME[:1]


def test_malformed_calls_among_parallel_ones_stay_content():
    good = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    content, calls = parse_tool_calls(f"Checking.\n{good}\n{broken}", NAMES)
    assert content == f"Checking.\n\n{broken}" and [c.name for c in calls] == ["get_time"]
    # bare JSON is read only when all of the text is calls
    for text in (
        '{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {"city": ',
        '{"name": "get_time", "parameters": {}}; {"name": "rm_rf", "parameters": {}}',
        '{"name": "get_time", "parameters": {}} is the call to make',
        '[{"name": "get_time", "arguments": {}}, 42]',
        "[1, 2, 3]",
    ):
        assert parse_tool_calls(text, NAMES) == (text, [])


def test_parallel_calls_in_a_whole_response(qwen):
    text = 'Both.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    c = Choice(0, qwen, frozenset())
    c.finish_reason, c.text = "stop", text
    for parallel, expected in ((None, TIME_AND_ROME), (True, TIME_AND_ROME), (False, TIME_AND_ROME[:1])):
        body = {"messages": HISTORY[:1], "tools": [WEATHER, TIME], "parallel_tool_calls": parallel}
        (choice,) = response(parse_chat(body, qwen), "m", [c], {})["choices"]
        message = choice["message"]
        assert choice["finish_reason"] == "tool_calls" and message["content"] == "Both."
        calls = message["tool_calls"]
        assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == expected
        assert all("index" not in t and t["type"] == "function" for t in calls)
        assert len({t["id"] for t in calls}) == len(calls)


def stream_through(job, text: str, tokenizer) -> tuple[str, str, list[dict]]:
    """What a stream sends for `text` fed a character at a time: (content sent as it came, content
    sent at the end, the tool_calls delta)."""
    hold = tool_stream(job)
    sent = "".join(hold.feed(ch) for ch in text)
    rest, calls = hold.finish()
    delta = chunk_choice(job, Choice(0, tokenizer, frozenset()), tool_calls=list(enumerate(calls)))["delta"]
    return sent, rest, delta.get("tool_calls", [])


def test_parallel_calls_in_a_stream(qwen, llama):
    hermes = 'Both.\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    bare = '{"name": "get_time", "parameters": {}}\n{"name": "get_weather", "parameters": {"city": "Rome"}}'
    for tokenizer, text, content in ((qwen, hermes, "Both.\n"), (llama, bare, "")):
        for parallel, expected in ((True, TIME_AND_ROME), (False, TIME_AND_ROME[:1])):
            body = {"messages": HISTORY[:1], "tools": [WEATHER, TIME], "parallel_tool_calls": parallel}
            sent, rest, deltas = stream_through(parse_chat(body, tokenizer), text, tokenizer)
            assert (sent, rest) == (content, "")
            # each call once: its index, id, type and name, with its arguments
            assert [d["index"] for d in deltas] == list(range(len(expected)))
            assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == expected
            assert all(d["id"].startswith("call_") and d["type"] == "function" for d in deltas)
            assert len({d["id"] for d in deltas}) == len(deltas)


def test_malformed_calls_in_a_stream_come_out_as_content(qwen):
    job = parse_chat({"messages": HISTORY[:1], "tools": [WEATHER, TIME]}, qwen)
    broken = '<tool_call>\n{"name": "get_time", "arguments": {</tool_call>'
    assert stream_through(job, "Hi " + broken, qwen) == ("Hi ", broken, [])
    unknown = '{"name": "rm_rf", "arguments": {}}\n{"name": "get_time", "arguments": {}}'
    assert stream_through(job, unknown, qwen) == ("", unknown, [])


MISTRAL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "a1b2c3d4e",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "a1b2c3d4e", "content": "sunny, 21C"},
]


def test_mistral_s_syntax_is_told_by_its_template_and_renders(mistral):
    job = parse_chat({"messages": MISTRAL_HISTORY, "tools": [WEATHER, TIME]}, mistral)
    assert job.tools.syntax == MISTRAL and job.tools.arguments_key == "arguments"
    text = prompt_text(mistral, {"messages": MISTRAL_HISTORY, "tools": [WEATHER, TIME]})
    assert '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "a1b2c3d4e"}]' in text
    assert '[TOOL_RESULTS]{"content": "sunny, 21C", "call_id": "a1b2c3d4e"}[/TOOL_RESULTS]' in text
    assert text.index("[AVAILABLE_TOOLS]") < text.index("[INST]Weather in Paris?")


class SpecialTokens:
    """A tokenizer with no chat template whose special tokens are `special`."""

    def __init__(self, *special: str, template: str | None = None):
        self.special, self.chat_template = special, template

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return [0] if parse_special and text in self.special else list(text.encode())


def test_the_call_syntax_is_told_by_special_tokens_without_a_template_that_names_it(qwen):
    assert call_syntax(SpecialTokens("[TOOL_CALLS]", "[ARGS]")) == MISTRAL
    assert call_syntax(SpecialTokens("<|python_tag|>")) == LLAMA3
    assert call_syntax(SpecialTokens()) == "hermes" and call_syntax(qwen) == "hermes"
    # a template's own markers come first (Hermes-style templates for Llama 3.1 models)
    assert call_syntax(SpecialTokens("<|python_tag|>", template="<tool_call>")) == "hermes"


@pytest.mark.parametrize(
    "text, content",
    [
        # v3 tokenizers: [TOOL_CALLS] and a list; as decoded, with the control token, or without it
        (
            '[TOOL_CALLS] [{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]',
            None,
        ),
        ('[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {"city": "Rome"}}]', None),
        # newer tokenizers: name[ARGS]{...} after each [TOOL_CALLS], with the markers or decoded away
        ('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', None),
        ('get_time{}get_weather{"city": "Rome"}', None),
        ('Let me look.[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}', "Let me look."),
        ('Let me look. get_time{}get_weather{"city": "Rome"}', "Let me look."),
    ],
)
def test_mistral_calls_are_read_back(text, content):
    got, calls = parse_tool_calls(text, NAMES, MISTRAL)
    assert got == content and names_and_args(calls) == TIME_AND_ROME
    # the ids Mistral's templates accept when the client sends the calls back
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls) and len({c.id for c in calls}) == 2
    got, calls = parse_tool_calls(text, NAMES, MISTRAL, parallel=False)
    assert got == content and names_and_args(calls) == TIME_AND_ROME[:1]


def test_malformed_mistral_calls_stay_content():
    for text in (
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ',
        "[TOOL_CALLS]rm_rf[ARGS]{}",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"} and then some',
        'get_weather{"city": "Rome"} is how it is called',
        "forget_time{}",  # a known name only as the end of another word
        "The weather is fine.",
    ):
        assert parse_tool_calls(text, NAMES, MISTRAL) == (text, [])
    # without Mistral's syntax a bare name is not read as a call
    assert parse_tool_calls("get_time{}", NAMES) == ("get_time{}", [])


def test_mistral_calls_whole_streamed_and_sent_back(mistral):
    body = {"messages": MISTRAL_HISTORY[:1], "tools": [WEATHER, TIME]}
    job = parse_chat(body, mistral)
    text = 'Let me look.[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}'
    c = Choice(0, mistral, frozenset())
    c.finish_reason, c.text = "stop", text
    (choice,) = response(job, "m", [c], {})["choices"]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls" and message["content"] == "Let me look."
    assert [
        (t["function"]["name"], json.loads(t["function"]["arguments"])) for t in message["tool_calls"]
    ] == TIME_AND_ROME
    # the calls and their results go back through the template, which checks their ids
    results = [{"role": "tool", "tool_call_id": t["id"], "content": "ok"} for t in message["tool_calls"]]
    follow_up = [
        *body["messages"],
        {"role": "assistant", **{k: message[k] for k in ("content", "tool_calls")}},
        *results,
    ]
    rendered = prompt_text(mistral, {"messages": follow_up, "tools": [WEATHER, TIME]})
    assert rendered.count("[TOOL_RESULTS]") == 2
    bad_id = [{**follow_up[1], "tool_calls": [{**message["tool_calls"][0], "id": "call_1"}]}]
    with pytest.raises(APIError, match="length 9"):
        parse_chat({"messages": [*body["messages"], *bad_id]}, mistral)
    # streamed: content goes out until a call may begin, with or without the control tokens
    for streamed in (text, text.replace("[TOOL_CALLS]", "").replace("[ARGS]", "")):
        sent, rest, deltas = stream_through(job, streamed, mistral)
        assert (sent, rest) == ("Let me look.", "")
        assert [(d["index"], d["function"]["name"]) for d in deltas] == [(0, "get_time"), (1, "get_weather")]
        assert all(len(d["id"]) == 9 for d in deltas)
    # text that only looks like the start of a call comes out as it goes
    hold = job.tools.stream()
    words = "I forget; get the time with get_time (get it?)."
    assert "".join(hold.feed(ch) for ch in words) == words and hold.finish() == ("", [])
    hold = job.tools.stream()
    assert hold.feed("Ask get_ti") == "Ask " and hold.feed("me{") == "" and hold.feed("} twice") == ""
    assert hold.finish() == ("get_time{} twice", [])


def test_a_forced_choice_writes_one_call_or_with_parallel_calls_a_list(qwen):
    body = {"messages": HISTORY[:1], "tools": [WEATHER, TIME]}
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice, names in (("required", ["get_weather", "get_time"]), (named, ["get_weather"])):
        one = parse_chat({**body, "tool_choice": choice, "parallel_tool_calls": False}, qwen)
        call = one.tools.schema()
        options = call.get("anyOf", [call])
        assert one.grammar is not None and [o["properties"]["name"]["const"] for o in options] == names
        several = parse_chat({**body, "tool_choice": choice}, qwen)
        assert several.grammar is not None
        assert several.tools.schema() == {"type": "array", "items": call, "minItems": 1}


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
        ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "must be true or false", "parallel_tool_calls"),
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


async def sse_events(r) -> list[dict]:
    return [
        json.loads(line[6:])
        for line in (await r.text()).splitlines()
        if line.startswith("data: ") and line != "data: [DONE]"
    ]


def test_a_forced_tool_choice_makes_the_model_call_it_over_http(qwen):
    """A random-weight model, in process behind the real HTTP app: a named tool_choice makes it
    write a valid call, returned as tool_calls whole and streamed."""
    from aiohttp import ClientSession

    from served import served

    path = model_path("qwen2", "F32")
    m = open_model(path)

    async def scenario():
        body = {
            "messages": [{"role": "user", "content": "Weather in Rome?"}],
            "tools": [TIME, WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "parallel_tool_calls": False,
            "max_tokens": 60,
            "seed": 1,
        }
        async with served(load_stage(m, 0, m.config.n_layers), qwen, n_slots=2) as base, ClientSession() as http:
            url = base + "/v1/chat/completions"
            async with http.post(url, json=body) as r:
                assert r.status == 200, await r.text()
                (choice,) = (await r.json())["choices"]
            assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            (call,) = choice["message"]["tool_calls"]
            assert call["function"]["name"] == "get_weather" and call["id"].startswith("call_")
            assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")

            async with http.post(url, json={**body, "stream": True}) as r:
                assert r.status == 200
                events = await sse_events(r)
            deltas = [e["choices"][0]["delta"] for e in events]
            streamed = [d["tool_calls"] for d in deltas if "tool_calls" in d]
            assert streamed == [[{**call, "index": 0, "id": streamed[0][0]["id"]}]]  # same call (seeded)
            assert not any(d.get("content") for d in deltas)
            assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"

            # parallel calls: one or more, the same whole and streamed (seeded)
            several = {**body, "parallel_tool_calls": True, "max_tokens": 200}
            async with http.post(url, json=several) as r:
                (choice,) = (await r.json())["choices"]
            assert choice["finish_reason"] == "tool_calls"
            calls = choice["message"]["tool_calls"]
            assert calls and {c["function"]["name"] for c in calls} == {"get_weather"}
            assert len({c["id"] for c in calls}) == len(calls)
            async with http.post(url, json={**several, "stream": True}) as r:
                events = await sse_events(r)
            (streamed,) = [
                e["choices"][0]["delta"]["tool_calls"] for e in events if "tool_calls" in e["choices"][0]["delta"]
            ]
            assert [c.pop("index") for c in streamed] == list(range(len(calls)))
            assert [c["function"] for c in streamed] == [c["function"] for c in calls]

            # "auto" with a model that writes no call: plain content, finish "stop" or "length"
            auto = {**body, "tool_choice": "auto", "max_tokens": 8}
            async with http.post(url, json=auto) as r:
                (choice,) = (await r.json())["choices"]
            assert choice["finish_reason"] in ("stop", "length") and isinstance(choice["message"]["content"], str)
            async with http.post(url, json={**body, "tool_choice": {"type": "function"}}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "tool_choice"

    asyncio.run(scenario())


@pytest.fixture(scope="module")
def glm():
    """GLM-4.5's own chat template (GLM-4.6's, as llama.cpp's tests keep it; 4.5's writes calls alike)."""
    convert = pytest.importorskip("shardwire_kit.convert")
    tokenizer = load_tokenizer(open_model(model_path("qwen2", "F32")))
    tokenizer.chat_template = convert.chat_template("GLM-4.6")
    return tokenizer


FORECAST = {
    "type": "function",
    "function": {
        "name": "forecast",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "units": {"type": "object"}},
        },
    },
}


def test_glm_s_syntax_is_told_by_its_template_and_its_call_history_renders(glm):
    assert call_syntax(glm) == GLM
    text = prompt_text(glm, {"messages": HISTORY, "tools": [WEATHER, TIME]})
    assert "<tools>" in text and json.dumps(WEATHER, ensure_ascii=False) in text
    assert "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>" in text
    assert "<|observation|>\n<tool_response>\nsunny, 21C\n</tool_response>" in text


def test_calls_written_as_glm_s_template_writes_them_are_read_back(glm):
    history = [
        {"role": "user", "content": "Three days in Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "forecast", "arguments": '{"city": "1984", "days": 3, "units": {"t": "C"}}'},
                },
                {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            ],
        },
    ]
    rendered = prompt_text(glm, {"messages": history, "tools": [FORECAST, TIME]})
    turn = rendered.split("<|assistant|>\n<think></think>\n", 1)[1].rsplit("<|assistant|>", 1)[0]
    spec = parse_chat({"messages": history[:1], "tools": [FORECAST, TIME]}, glm).tools
    content, calls = spec.read_calls(turn)
    assert content == "Checking."
    # a string parameter's value stays text even where it reads as JSON ("1984"); the others are JSON
    assert names_and_args(calls) == [("forecast", {"city": "1984", "days": 3, "units": {"t": "C"}}), ("get_time", {})]
    # not a call: an unknown function, text between the arguments, an unclosed key
    for text in (
        "<tool_call>rm_rf\n<arg_key>path</arg_key>\n<arg_value>/</arg_value>\n</tool_call>",
        "<tool_call>forecast\nplease\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
        "<tool_call>forecast\n<arg_key>city\n<arg_value>Rome</arg_value>\n</tool_call>",
    ):
        assert spec.read_calls(text) == (text, [])


def test_glm_calls_in_a_stream(glm):
    text = "Both.\n<tool_call>get_time\n</tool_call>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>"
    body = {"messages": HISTORY[:1], "tools": [WEATHER, TIME]}
    sent, rest, deltas = stream_through(parse_chat(body, glm), text, glm)
    assert (sent, rest) == ("Both.\n", "")
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == TIME_AND_ROME


def _templated(name: str):
    convert = pytest.importorskip("shardwire_kit.convert")
    tokenizer = load_tokenizer(open_model(model_path("qwen2", "F32")))
    tokenizer.chat_template = convert.chat_template(name)
    return tokenizer


@pytest.fixture(scope="module")
def deepseek():
    return _templated("deepseek-ai-DeepSeek-V3.1")


@pytest.fixture(scope="module")
def kimi():
    return _templated("moonshotai-Kimi-K2")


TWO_CALLS = [
    {
        "role": "assistant",
        "content": "Checking.",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
        ],
    }
]


@pytest.mark.parametrize(
    "fixture,syntax,after",
    [
        ("deepseek", DEEPSEEK, "<｜Assistant｜><think></think>"),
        ("kimi", KIMI, "<|im_assistant|>assistant<|im_middle|>"),
    ],
)
def test_deepseek_s_and_kimi_s_calls_render_through_their_templates_and_are_read_back(request, fixture, syntax, after):
    tokenizer = request.getfixturevalue(fixture)
    assert call_syntax(tokenizer) == syntax
    history = HISTORY[:1] + TWO_CALLS
    rendered = prompt_text(tokenizer, {"messages": history, "tools": [WEATHER, TIME]})
    turn = rendered.split(after)[1]
    turn = turn.split("<｜end▁of▁sentence｜>")[0].split("<|im_end|>")[0]
    spec = parse_chat({"messages": HISTORY[:1], "tools": [WEATHER, TIME]}, tokenizer).tools
    content, calls = spec.read_calls(turn)
    assert content == "Checking." and names_and_args(calls) == TIME_AND_ROME
    if syntax == KIMI:  # its calls are known by the ids it writes them under
        assert [c.id for c in calls] == ["functions.get_time:0", "functions.get_weather:1"]
    sent, rest, deltas = stream_through(
        parse_chat({"messages": HISTORY[:1], "tools": [WEATHER, TIME]}, tokenizer), turn, tokenizer
    )
    assert (sent, rest) == ("Checking.", "")
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == TIME_AND_ROME


def test_deepseek_v3_s_fenced_calls_are_read_and_malformed_sections_stay_content():
    v3 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert names_and_args(parse_tool_calls(v3, NAMES, DEEPSEEK)[1]) == [("get_weather", {"city": "Rome"})]
    for text in (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>rm_rf<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "<|tool_calls_section_begin|>stray<|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>{}<|tool_call_end|>",
    ):
        assert parse_tool_calls(text, NAMES, DEEPSEEK if "｜" in text else KIMI) == (text, [])


def test_gpt_oss_s_harmony_calls_are_read_apart_from_its_reasoning_whole_and_streamed():
    """A harmony reply (reasoning, then a message to=functions.NAME) through a job of gpt-oss's
    own template: the analysis channel comes back as reasoning, the message as a call; a call of an
    unknown function or with broken arguments stays content."""
    from shardwire.engine import Event
    from shardwire.serving.harmony import HarmonySplit
    from shardwire.serving.openai_api import usage
    from shardwire.serving.tools import HARMONY

    convert = pytest.importorskip("shardwire_kit.convert")

    class Harmony:
        chat_template = convert.chat_template("openai-gpt-oss-120b")

        def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
            from shardwire.serving.chat import render_chat

            return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **extra)

        def encode(self, text, add_special=True, parse_special=False):
            return [ord(c) for c in text]

    tokenizer = Harmony()
    assert call_syntax(tokenizer) == HARMONY
    timed = {"type": "function", "function": {**TIME["function"], "description": "The time."}}  # its template reads one
    job = parse_chat({"messages": HISTORY[:1], "tools": [WEATHER, timed]}, tokenizer)
    reply = (
        "<|channel|>analysis<|message|>Needs the weather.<|end|>"
        '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}'
    )
    choice = Choice(0, None, frozenset(), job)
    choice.add(Event(reply, finish_reason="stop"))
    (out,) = response(job, "m", [choice], usage(1, 4))["choices"]
    assert out["finish_reason"] == "tool_calls" and out["message"]["reasoning_content"] == "Needs the weather."
    assert out["message"]["content"] is None
    assert names_and_args([c for c in job.tools.read_calls(choice.text)[1]]) == [("get_weather", {"city": "Rome"})]
    split = HarmonySplit()
    answer = "".join(split.feed(ch)[1] for ch in reply) + split.flush()[1]
    sent, rest, deltas = stream_through(job, answer, tokenizer)
    assert (sent, rest) == ("", "")
    assert [(d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == [
        ("get_weather", {"city": "Rome"})
    ]
    for broken in ('{"city": ', "rm_rf"):
        text = (
            answer.replace('{"city": "Rome"}', broken)
            if broken.startswith("{")
            else answer.replace("get_weather", broken)
        )
        assert parse_tool_calls(text, NAMES, HARMONY) == (text, [])
