"""OpenAI request parsing and response shapes (shardwire/openai_api.py): pure functions over dicts,
tested with a small fake tokenizer (and once with a real one)."""

from __future__ import annotations

import time

import pytest

from shardwire.engine import Event
from shardwire.sampling import SamplingParams
from shardwire.serving.openai_api import (
    MAX_CHOICES,
    MAX_STOPS,
    SYSTEM_FINGERPRINT,
    APIError,
    Choice,
    Job,
    bad_request,
    chunk,
    chunk_choice,
    parse_chat,
    parse_completion,
    response,
    unavailable,
    usage,
)

BOS = 1


class FakeTokenizer:
    """Characters are tokens (token id = code point); BOS is 1; "<s>" is a special token text.
    Records how encode and the chat template were called."""

    vocab_size = 1000
    stop_ids = frozenset({2})

    def __init__(self, add_bos: bool = True):
        self.add_bos = add_bos
        self.encode_calls: list[tuple[str, bool, bool]] = []
        self.templated: list[list[dict]] = []

    def encode(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        self.encode_calls.append((text, add_special, parse_special))
        ids = []
        while text:
            if parse_special and text.startswith("<s>"):
                ids.append(BOS)
                text = text[3:]
            else:
                ids.append(ord(text[0]))
                text = text[1:]
        return ([BOS] if add_special and self.add_bos else []) + ids

    def decode(self, ids, skip_special: bool = True) -> str:
        return "".join("" if (i == BOS and skip_special) else ("<s>" if i == BOS else chr(i)) for i in ids)

    def token_text(self, id: int) -> str:
        return {BOS: "<s>", 2: "</s>"}.get(id, chr(id))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra) -> str:
        self.templated.append(messages)
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this template has no tool role")
        return "".join(f"[{m['role']}]{m['content']}" for m in messages)


@pytest.fixture
def tok():
    return FakeTokenizer()


def ords(text: str) -> list[int]:
    return [ord(c) for c in text]


def bad(parse, body, tok, *fragments, param=None):
    """parse(body) must answer 400 in OpenAI's error shape, with every fragment in its message."""
    with pytest.raises(APIError) as info:
        parse(body, tok)
    e = info.value
    assert e.status == 400 and e.type == "invalid_request_error"
    for fragment in fragments:
        assert fragment in e.message, (fragment, e.message)
    if param is not None:
        assert e.param == param
    assert e.body() == {
        "error": {"message": e.message, "type": "invalid_request_error", "param": e.param, "code": e.code}
    }
    return e


# -- completions -------------------------------------------------------------------------------


def test_completion_defaults_are_openai_s(tok):
    job = parse_completion({"prompt": "hi"}, tok)
    assert job.kind == "text"
    assert job.prompts == [[BOS] + ords("hi")]
    assert job.n == 1 and job.max_tokens is None and job.stop == ()
    assert (job.stream, job.include_usage, job.ignore_eos, job.echo) == (False, False, False, [])
    assert job.sampling == SamplingParams(
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        min_p=0.0,
        repeat_penalty=1.0,
        frequency_penalty=0.0,
        presence_penalty=0.0,
        repeat_last_n=64,
        seed=None,
        logprobs=None,
    )
    assert job.logprobs is None
    assert job.id.startswith("cmpl-") and len(job.id) == len("cmpl-") + 24
    assert abs(job.created - time.time()) < 5
    # text is tokenized as llama-server does: BOS as the model says, special-token text read as tokens
    assert tok.encode_calls == [("hi", True, True)]


def test_completion_prompt_forms(tok):
    assert parse_completion({"prompt": ["ab", "c"]}, tok).prompts == [[BOS, 97, 98], [BOS, 99]]
    assert parse_completion({"prompt": [5, 6, 7]}, tok).prompts == [[5, 6, 7]]
    assert parse_completion({"prompt": [[5], [6, 7]]}, tok).prompts == [[5], [6, 7]]
    assert parse_completion({"prompt": ["a", [9]]}, tok).prompts == [[BOS, 97], [9]]
    assert parse_completion({"prompt": "x<s>y"}, tok).prompts == [[BOS, 120, BOS, 121]]
    assert parse_completion({"prompt": [0, 999]}, tok).prompts == [[0, 999]]


def test_completion_sampling_fields(tok):
    job = parse_completion(
        {
            "prompt": "a",
            "temperature": 0.5,
            "top_p": 0.9,
            "seed": 42,
            "max_tokens": 7,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "logprobs": 3,
        },
        tok,
    )
    s = job.sampling
    assert (s.temperature, s.top_p, s.seed, s.presence_penalty, s.frequency_penalty) == (0.5, 0.9, 42, 0.5, -1.0)
    assert s.logprobs == 3 == job.logprobs
    assert isinstance(s.temperature, float) and isinstance(s.frequency_penalty, float)
    assert job.max_tokens == 7
    assert parse_completion({"prompt": "a", "max_tokens": 0}, tok).max_tokens == 0
    assert parse_completion({"prompt": "a", "logprobs": 0}, tok).logprobs == 0
    assert parse_completion({"prompt": "a", "logprobs": 20}, tok).logprobs == 20
    assert parse_completion({"prompt": "a", "temperature": 0}, tok).sampling.greedy
    assert parse_completion({"prompt": "a", "temperature": 2}, tok).sampling.temperature == 2.0


def test_null_fields_take_their_defaults(tok):
    body = {
        "prompt": "a",
        "temperature": None,
        "top_p": None,
        "n": None,
        "max_tokens": None,
        "stop": None,
        "stream": None,
        "seed": None,
        "logprobs": None,
        "echo": None,
        "stream_options": None,
    }
    job = parse_completion(body, tok)
    assert (job.sampling.temperature, job.sampling.top_p, job.n, job.max_tokens, job.stop, job.stream) == (
        1.0,
        1.0,
        1,
        None,
        (),
        False,
    )


def test_top_p_zero_means_greedy(tok):
    s = parse_completion({"prompt": "a", "top_p": 0, "temperature": 0.7}, tok).sampling
    assert (s.temperature, s.top_p) == (0.0, 1.0)


def test_seed_any_integer_is_folded_into_63_bits(tok):
    assert parse_completion({"prompt": "a", "seed": -1}, tok).sampling.seed == (1 << 63) - 1
    assert parse_completion({"prompt": "a", "seed": (1 << 64) + 5}, tok).sampling.seed == 5
    assert parse_completion({"prompt": "a", "seed": 0}, tok).sampling.seed == 0


def test_llama_server_extras(tok):
    job = parse_completion(
        {"prompt": "a", "top_k": 40, "min_p": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 32, "ignore_eos": True}, tok
    )
    s = job.sampling
    assert (s.top_k, s.min_p, s.repeat_penalty, s.repeat_last_n) == (40, 0.1, 1.1, 32)
    assert s.penalized and job.ignore_eos is True
    chat = parse_chat({"messages": [{"role": "user", "content": "x"}], "top_k": 5, "ignore_eos": True}, tok)
    assert chat.sampling.top_k == 5 and chat.ignore_eos


def test_echo_keeps_each_prompt_s_text(tok):
    job = parse_completion({"prompt": ["ab", [BOS, 99]], "echo": True}, tok)
    assert job.echo == ["ab", "<s>c"]  # token ids are decoded with their special tokens
    assert parse_completion({"prompt": "ab", "echo": False}, tok).echo == []


def test_stop(tok):
    def stop(value):
        return parse_completion({"prompt": "a", "stop": value}, tok).stop

    assert stop("\n") == ("\n",)
    assert stop(["a", "bc"]) == ("a", "bc")
    assert stop(["", "x"]) == ("x",)  # empty strings stop nothing
    assert stop([]) == ()
    assert stop(["1", "2", "3", "4"]) == ("1", "2", "3", "4")


def test_unknown_fields_are_ignored(tok):
    job = parse_completion({"prompt": "a", "model": "anything", "user": "u-1", "best_of": 1, "x_custom": {}}, tok)
    assert job.prompts == [[BOS, 97]]


@pytest.mark.parametrize(
    "prompt", [None, "", [], {}, 5, [1.5], [True, 2], ["a", 5], [[1], "a", None], [["a"]], [[]], [[1, [2]]]]
)
def test_completion_bad_prompts(tok, prompt):
    body = {} if prompt is None else {"prompt": prompt}
    tok.add_bos = False  # so "" tokenizes to nothing
    e = bad(parse_completion, body, tok, param="prompt")
    assert "prompt" in e.message


def test_completion_empty_prompt_message(tok):
    tok.add_bos = False
    bad(parse_completion, {"prompt": ""}, tok, "the prompt is empty")
    bad(parse_completion, {"prompt": [[]]}, tok, "the prompt is empty")
    bad(
        parse_completion,
        {"prompt": {"text": "a"}},
        tok,
        "'prompt' must be a string, a list of strings or a list of token ids",
    )


@pytest.mark.parametrize("ids", [[1000], [-1], [5, 1000], [[3], [1 << 40]]])
def test_completion_token_ids_outside_the_vocabulary(tok, ids):
    bad(parse_completion, {"prompt": ids}, tok, "token ids must be in [0, 1000)", param="prompt")


NUMBER_CASES = [
    ("temperature", 2.5, "'temperature' must be between 0 and 2, got 2.5"),
    ("temperature", -0.1, "'temperature' must be between 0 and 2"),
    ("temperature", "hot", "'temperature' must be a number"),
    ("temperature", True, "'temperature' must be a number"),
    ("temperature", [1], "'temperature' must be a number"),
    ("top_p", 1.5, "'top_p' must be between 0 and 1"),
    ("top_p", -0.5, "'top_p' must be between 0 and 1"),
    ("n", 0, "'n' must be between 1 and 128, got 0"),
    ("n", MAX_CHOICES + 1, "'n' must be between 1 and 128"),
    ("n", 1.5, "'n' must be an integer"),
    ("n", "2", "'n' must be an integer"),
    ("n", True, "'n' must be an integer"),
    ("max_tokens", -1, "'max_tokens' must be at least 0, got -1"),
    ("max_tokens", 5.0, "'max_tokens' must be an integer"),
    ("max_tokens", "5", "'max_tokens' must be an integer"),
    ("seed", 1.5, "'seed' must be an integer"),
    ("seed", False, "'seed' must be an integer"),
    ("presence_penalty", 2.1, "'presence_penalty' must be between -2 and 2"),
    ("frequency_penalty", -3, "'frequency_penalty' must be between -2 and 2"),
    ("top_k", -1, "'top_k' must be at least 0"),
    ("top_k", 4.5, "'top_k' must be an integer"),
    ("min_p", 1.5, "'min_p' must be between 0 and 1"),
    ("repeat_penalty", 0, "'repeat_penalty' must be between 0.01 and 10"),
    ("repeat_penalty", 11, "'repeat_penalty' must be between 0.01 and 10"),
    ("repeat_last_n", -1, "'repeat_last_n' must be at least 0"),
    ("logprobs", 21, "'logprobs' must be between 0 and 20, got 21"),
    ("logprobs", -1, "'logprobs' must be between 0 and 20"),
    ("logprobs", True, "'logprobs' must be an integer"),  # completions take a count, not a flag
]


@pytest.mark.parametrize("field, value, message", NUMBER_CASES)
def test_completion_bad_numbers(tok, field, value, message):
    bad(parse_completion, {"prompt": "a", field: value}, tok, message, param=field)


@pytest.mark.parametrize("field, value, message", [c for c in NUMBER_CASES if c[0] != "logprobs"])
def test_chat_bad_numbers(tok, field, value, message):
    bad(parse_chat, {"messages": [{"role": "user", "content": "x"}], field: value}, tok, message, param=field)


@pytest.mark.parametrize("stop", [5, {"a": 1}, [1], ["a", None], [str(i) for i in range(MAX_STOPS + 1)]])
def test_bad_stop(tok, stop):
    bad(
        parse_completion,
        {"prompt": "a", "stop": stop},
        tok,
        f"'stop' must be a string or a list of at most {MAX_STOPS} strings",
        param="stop",
    )


@pytest.mark.parametrize("field, value", [("stream", "yes"), ("stream", 1), ("echo", "true"), ("ignore_eos", 0)])
def test_flags_must_be_booleans(tok, field, value):
    bad(parse_completion, {"prompt": "a", field: value}, tok, f"'{field}' must be true or false", param=field)


def test_choices_are_limited_over_prompts_times_n(tok):
    assert parse_completion({"prompt": ["a", "b"], "n": 64}, tok).n == 64
    bad(parse_completion, {"prompt": ["a", "b"], "n": 65}, tok, "at most 128 choices (prompts x n)", param="n")
    bad(parse_completion, {"prompt": [[1]] * 129}, tok, "at most 128 choices", param="n")


@pytest.mark.parametrize(
    "field, value",
    [
        ("tools", [{"type": "function"}]),
        ("functions", [{"name": "f"}]),
        ("suffix", "end"),
    ],
)
def test_unsupported_features_are_refused(tok, field, value):
    bad(parse_completion, {"prompt": "a", field: value}, tok, f"'{field}' is not supported", param=field)
    if field != "tools":  # chat takes tools (test_tools.py)
        chat = {"messages": [{"role": "user", "content": "x"}], field: value}
        bad(parse_chat, chat, tok, "not supported", param=field)


def test_empty_unsupported_fields_are_accepted(tok):
    job = parse_chat(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [],
            "logit_bias": {},
            "suffix": "",
            "response_format": {"type": "text"},
        },
        tok,
    )
    assert job.kind == "chat"


@pytest.mark.parametrize(
    "fmt, message",
    [
        ({"type": "json_schema", "json_schema": {}}, "needs json_schema.schema"),
        ({"type": "xml"}, "response_format.type must be"),
        ("text", "response_format.type must be"),
        ([], "response_format.type must be"),
    ],
)
def test_bad_response_formats_are_refused(tok, fmt, message):
    """Valid ones are tested with a real tokenizer in test_constrain.py."""
    bad(
        parse_chat,
        {"messages": [{"role": "user", "content": "x"}], "response_format": fmt},
        tok,
        message,
        param="response_format",
    )


def test_stream_and_usage(tok):
    job = parse_completion({"prompt": "a", "stream": True}, tok)
    assert job.stream and not job.include_usage
    job = parse_completion({"prompt": "a", "stream": True, "stream_options": {"include_usage": True}}, tok)
    assert job.stream and job.include_usage
    # usage in a stream only: without stream the option changes nothing
    job = parse_completion({"prompt": "a", "stream_options": {"include_usage": True}}, tok)
    assert not job.stream and not job.include_usage
    bad(
        parse_completion,
        {"prompt": "a", "stream": True, "stream_options": ["include_usage"]},
        tok,
        "'stream_options' must be an object",
        param="stream_options",
    )
    bad(
        parse_completion,
        {"prompt": "a", "stream": True, "stream_options": {"include_usage": "yes"}},
        tok,
        "'include_usage' must be true or false",
    )


# -- chat --------------------------------------------------------------------------------------


def test_chat_renders_the_template_and_reads_special_tokens(tok):
    job = parse_chat(
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <s>"}]}, tok
    )
    text = "[system]be brief[user]hi <s>"
    assert job.kind == "chat" and job.id.startswith("chatcmpl-")
    assert tok.encode_calls == [(text, False, True)]  # the template wrote BOS if the model wants one
    assert job.prompts == [ords(text[:-3]) + [BOS]]
    assert job.sampling.temperature == 1.0 and job.sampling.top_p == 1.0 and job.logprobs is None
    assert job.max_tokens is None and job.n == 1


def test_chat_message_forms(tok):
    parse_chat(
        {
            "messages": [
                {"role": "developer", "content": "rules"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None, "name": "bot"},
                {"role": "user"},
            ]
        },
        tok,
    )
    (messages,) = tok.templated
    assert messages == [
        {"role": "system", "content": "rules"},  # templates know system, not developer
        {"role": "user", "content": "a\n\nb"},  # parts joined as llama-server joins them
        {"role": "assistant", "content": "", "name": "bot"},
        {"role": "user", "content": ""},
    ]


@pytest.mark.parametrize(
    "messages, fragment, param",
    [
        (None, "'messages' must be a non-empty list", "messages"),
        ([], "'messages' must be a non-empty list", "messages"),
        ("hello", "'messages' must be a non-empty list", "messages"),
        ({"role": "user"}, "'messages' must be a non-empty list", "messages"),
        (["hello"], "messages[0] must be an object with a role of", "messages[0]"),
        ([{"content": "x"}], "messages[0] must be an object with a role of", "messages[0]"),
        (
            [{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}],
            "messages[1] must be an object with a role of assistant, developer, system, tool, user",
            "messages[1]",
        ),
        (
            [{"role": "user", "content": 5}],
            "messages[0].content must be a string or a list of text parts",
            "messages[0].content",
        ),
        (
            [{"role": "user", "content": {"text": "x"}}],
            "must be a string or a list of text parts",
            "messages[0].content",
        ),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0]: only text content parts are supported",
            "messages[0].content",
        ),
        (
            [{"role": "user", "content": [{"type": "text", "text": 5}]}],
            "only text content parts",
            "messages[0].content",
        ),
        ([{"role": "user", "content": ["plain"]}], "only text content parts", "messages[0].content"),
    ],
)
def test_chat_bad_messages(tok, messages, fragment, param):
    body = {} if messages is None else {"messages": messages}
    bad(parse_chat, body, tok, fragment, param=param)


@pytest.mark.parametrize("role", [["user"], {"name": "user"}])
def test_chat_role_of_the_wrong_type_is_a_bad_request(tok, role):
    bad(
        parse_chat,
        {"messages": [{"role": role, "content": "x"}]},
        tok,
        "messages[0] must be an object with a role",
        param="messages[0]",
    )


def test_chat_template_errors_are_bad_requests(tok):
    bad(
        parse_chat,
        {"messages": [{"role": "tool", "content": "42"}]},
        tok,
        "this template has no tool role",
        param="messages",
    )


def test_chat_rendering_to_nothing_is_a_bad_request(tok):
    bad(
        parse_chat,
        {"messages": [{"role": "user", "content": ""}]},
        FakeTokenizerRenderingNothing(),
        "the rendered chat prompt is empty",
        param="messages",
    )


class FakeTokenizerRenderingNothing(FakeTokenizer):
    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        return ""


def test_chat_logprobs(tok):
    msgs = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": msgs, "logprobs": True}, tok).logprobs == 0
    assert parse_chat({"messages": msgs, "logprobs": True, "top_logprobs": 5}, tok).logprobs == 5
    assert parse_chat({"messages": msgs, "logprobs": True, "top_logprobs": 20}, tok).logprobs == 20
    assert parse_chat({"messages": msgs, "logprobs": False}, tok).logprobs is None
    bad(
        parse_chat,
        {"messages": msgs, "top_logprobs": 3},
        tok,
        "'top_logprobs' needs 'logprobs': true",
        param="top_logprobs",
    )
    bad(parse_chat, {"messages": msgs, "logprobs": False, "top_logprobs": 3}, tok, "needs 'logprobs'")
    bad(
        parse_chat,
        {"messages": msgs, "logprobs": True, "top_logprobs": 21},
        tok,
        "'top_logprobs' must be between 0 and 20",
        param="top_logprobs",
    )
    bad(parse_chat, {"messages": msgs, "logprobs": True, "top_logprobs": -1}, tok, "between 0 and 20")
    bad(parse_chat, {"messages": msgs, "logprobs": 5}, tok, "'logprobs' must be true or false", param="logprobs")


def test_chat_max_tokens_fields(tok):
    msgs = [{"role": "user", "content": "x"}]
    assert parse_chat({"messages": msgs, "max_tokens": 9}, tok).max_tokens == 9
    assert parse_chat({"messages": msgs, "max_completion_tokens": 4}, tok).max_tokens == 4
    assert parse_chat({"messages": msgs, "max_completion_tokens": 4, "max_tokens": 9}, tok).max_tokens == 4
    assert parse_chat({"messages": msgs, "max_completion_tokens": 0}, tok).max_tokens == 0
    bad(
        parse_chat,
        {"messages": msgs, "max_completion_tokens": -1},
        tok,
        "'max_completion_tokens' must be at least 0, got -1",
        param="max_completion_tokens",
    )
    bad(parse_chat, {"messages": msgs, "max_tokens": -2}, tok, "'max_tokens' must be at least 0", param="max_tokens")


def test_chat_with_a_real_tokenizer():
    from shardwire.formats import open_model
    from shardwire.tokenizer import load_tokenizer

    from models import model_path

    tokenizer = load_tokenizer(open_model(model_path("qwen2")))
    job = parse_chat({"messages": [{"role": "user", "content": "hello"}], "seed": 3, "n": 2}, tokenizer)
    (prompt,) = job.prompts
    text = tokenizer.decode(prompt, skip_special=False)
    assert text.startswith("<|im_start|>") and "hello" in text and text.endswith("<|im_start|>assistant\n")
    im_start = tokenizer.encode("<|im_start|>", add_special=False, parse_special=True)
    assert len(im_start) == 1 and prompt[0] == im_start[0]  # a control token, not its characters
    assert [r.sampling.seed for r in job.requests(4096)] == [3, 4]


# -- Job.requests ------------------------------------------------------------------------------


def test_requests_one_per_prompt_and_choice(tok):
    job = parse_completion(
        {"prompt": ["ab", "c"], "n": 3, "seed": 10, "max_tokens": 5, "stop": "x", "ignore_eos": True}, tok
    )
    reqs = job.requests(ctx=100)
    assert len(reqs) == 6
    assert [r.prompt for r in reqs] == [[BOS, 97, 98]] * 3 + [[BOS, 99]] * 3  # choice i * n + j: prompt i
    assert [r.sampling.seed for r in reqs] == [10, 11, 12] * 2  # choice j draws with seed + j
    assert all(r.max_tokens == 5 and r.stop == ("x",) and r.ignore_eos for r in reqs)
    assert all(r.sampling.temperature == 1.0 for r in reqs)


def test_requests_without_seed_or_max_tokens(tok):
    reqs = parse_completion({"prompt": "a", "n": 2}, tok).requests(ctx=50)
    assert [r.sampling.seed for r in reqs] == [None, None]  # the engine draws one per request
    assert [r.max_tokens for r in reqs] == [50, 50]  # up to the end of the context


def test_request_seeds_wrap_at_63_bits(tok):
    reqs = parse_completion({"prompt": "a", "n": 2, "seed": (1 << 63) - 1}, tok).requests(ctx=50)
    assert [r.sampling.seed for r in reqs] == [(1 << 63) - 1, 0]


def test_a_prompt_that_fills_the_context_is_refused(tok):
    job = parse_completion({"prompt": [[1, 2, 3], [1, 2, 3, 4]]}, tok)
    assert len(job.requests(ctx=5)) == 2
    with pytest.raises(APIError) as info:
        job.requests(ctx=4)
    e = info.value
    assert (e.status, e.param, e.code) == (400, "prompt", "context_length_exceeded")
    assert "maximum context length is 4 tokens" in e.message and "prompt resulted in 4 tokens" in e.message
    # llama-server's type, its words and its two extra fields
    assert e.type == "exceed_context_size_error" and "exceeds the available context size" in e.message
    assert e.body()["error"]["n_prompt_tokens"] == 4 and e.body()["error"]["n_ctx"] == 4
    chat = parse_chat({"messages": [{"role": "user", "content": "hello"}]}, tok)
    with pytest.raises(APIError) as info:
        chat.requests(ctx=3)
    assert info.value.param == "messages" and "messages resulted in" in info.value.message


# -- errors ------------------------------------------------------------------------------------


def test_error_shapes():
    e = bad_request("nope", "n", "some_code")
    assert (e.status, str(e)) == (400, "nope")
    assert e.body() == {
        "error": {"message": "nope", "type": "invalid_request_error", "param": "n", "code": "some_code"}
    }
    u = unavailable("loading")
    assert u.status == 503
    assert u.body() == {
        "error": {"message": "loading", "type": "unavailable_error", "param": None, "code": "unavailable"}
    }


# -- responses -----------------------------------------------------------------------------------


def events(*items):
    """Events from (text, token, logprob, top) tuples, then a finish."""
    return [Event(text, token, logprob, top) for text, token, logprob, top in items]


def test_usage():
    assert usage(3, 4, 2) == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 2},
    }


def test_choice_collects_text_logprobs_and_finish(tok):
    choice = Choice(0, tok, skip_ids=frozenset({2}))
    assert choice.add(Event("H", 72, -0.5, [(72, -0.5), (73, -1.0)])) == ("H", [(72, -0.5, [(72, -0.5), (73, -1.0)])])
    assert choice.add(Event("i", 105, None)) == ("i", [])  # no logprob: no entry
    assert choice.add(Event("", 2, -0.1)) == ("", [])  # the end-of-generation token is not reported
    assert choice.add(Event("!", finish_reason="length")) == ("!", [])
    assert choice.text == "Hi!" and choice.finish_reason == "length" and choice.error is None
    assert choice.logprobs == [(72, -0.5, [(72, -0.5), (73, -1.0)])]
    failed = Choice(1, tok, frozenset())
    failed.add(Event(finish_reason="error", error="worker lost"))
    assert (failed.finish_reason, failed.error) == ("error", "worker lost")


def test_chat_response_shape(tok):
    job = parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 2}, tok)
    a, b = Choice(0, tok, frozenset()), Choice(1, tok, frozenset())
    for e in (Event("O", 79), Event("K", 75), Event(finish_reason="stop")):
        a.add(e)
    b.add(Event("N", 78))
    b.add(Event(finish_reason="length"))
    out = response(job, "m.gguf", [a, b], usage(5, 3))
    assert out == {
        "id": job.id,
        "object": "chat.completion",
        "created": job.created,
        "model": "m.gguf",
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "OK", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            },
            {
                "index": 1,
                "message": {"role": "assistant", "content": "N", "refusal": None},
                "logprobs": None,
                "finish_reason": "length",
            },
        ],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 3,
            "total_tokens": 8,
            "prompt_tokens_details": {"cached_tokens": 0},
        },
    }


def test_chat_response_logprobs(tok):
    job = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 2}, tok)
    c = Choice(0, tok, frozenset())
    c.add(Event("é", 233, -0.25, [(233, -0.25), (101, -2.0)]))
    c.add(Event(finish_reason="stop"))
    (choice,) = response(job, "m", [c], usage(1, 1))["choices"]
    assert choice["logprobs"] == {
        "content": [
            {
                "token": "é",
                "logprob": -0.25,
                "bytes": [0xC3, 0xA9],
                "top_logprobs": [
                    {"token": "é", "logprob": -0.25, "bytes": [0xC3, 0xA9]},
                    {"token": "e", "logprob": -2.0, "bytes": [101]},
                ],
            }
        ],
        "refusal": None,
    }
    # logprobs asked for with no top alternatives: an empty list each
    job = parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, tok)
    c = Choice(0, tok, frozenset())
    c.add(Event("a", 97, -1.5, []))
    assert response(job, "m", [c], usage(1, 1))["choices"][0]["logprobs"]["content"] == [
        {"token": "a", "logprob": -1.5, "bytes": [97], "top_logprobs": []}
    ]


def test_text_response_with_echo_and_logprobs(tok):
    job = parse_completion({"prompt": ["ab", "xyz"], "n": 2, "echo": True, "logprobs": 1}, tok)
    choices = []
    for i in range(4):
        c = Choice(i, tok, frozenset())
        c.add(Event("c", 99, -0.1, [(99, -0.1)]))
        c.add(Event("d", 100, -0.2, [(101, -0.05)]))
        if i == 0:
            c.add(Event("", BOS, -0.3, []))  # a control token: its piece "<s>" is 3 characters
            c.add(Event("e", 101, -0.4, []))
        c.add(Event(finish_reason="length"))
        choices.append(c)
    out = response(job, "m", choices, usage(7, 8))
    assert out["object"] == "text_completion" and out["id"].startswith("cmpl-")
    assert [c["text"] for c in out["choices"]] == ["abcde", "abcd", "xyzcd", "xyzcd"]  # choice i: prompt i // n
    assert out["choices"][1]["logprobs"] == {
        "tokens": ["c", "d"],
        "token_logprobs": [-0.1, -0.2],
        "top_logprobs": [{"c": -0.1}, {"e": -0.05}],
        "text_offset": [2, 3],
    }
    assert out["choices"][0]["logprobs"]["tokens"] == ["c", "d", "<s>", "e"]
    assert out["choices"][0]["logprobs"]["text_offset"] == [2, 3, 4, 7]
    assert out["choices"][2]["logprobs"]["text_offset"] == [3, 4]  # after the echoed prompt
    assert all(c["finish_reason"] == "length" for c in out["choices"])


def test_text_response_without_logprobs(tok):
    job = parse_completion({"prompt": "ab"}, tok)
    c = Choice(0, tok, frozenset())
    c.add(Event("z", 122, -0.3))
    c.add(Event(finish_reason="stop"))
    assert response(job, "m", [c], usage(3, 1))["choices"] == [
        {"index": 0, "text": "z", "finish_reason": "stop", "logprobs": None}
    ]


def test_stream_chunks(tok):
    job = parse_chat({"messages": [{"role": "user", "content": "x"}]}, tok)
    c = Choice(0, tok, frozenset())
    first = chunk(job, "m", [chunk_choice(job, c, role=True)])
    assert first == {
        "id": job.id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": "m",
        "system_fingerprint": SYSTEM_FINGERPRINT,
        "choices": [
            {"index": 0, "delta": {"role": "assistant", "content": None}, "finish_reason": None, "logprobs": None}
        ],
    }
    assert "usage" not in first  # only with stream_options.include_usage
    assert chunk_choice(job, c, text="Hi")["delta"] == {"content": "Hi"}
    end = chunk_choice(job, c, finish_reason="stop")
    assert end == {"index": 0, "delta": {}, "finish_reason": "stop", "logprobs": None}
    with_lp = chunk_choice(job, c, text="", entries=[(97, -1.0, [])])
    assert with_lp["delta"] == {"content": ""} and with_lp["logprobs"]["content"][0]["token"] == "a"


def test_stream_chunks_with_usage(tok):
    job = parse_completion({"prompt": "ab", "stream": True, "stream_options": {"include_usage": True}}, tok)
    c = Choice(0, tok, frozenset())
    body = chunk(job, "m", [chunk_choice(job, c, text="q")])
    assert body["object"] == "text_completion" and body["usage"] is None  # every chunk carries it, null
    assert body["choices"] == [{"index": 0, "text": "q", "finish_reason": None, "logprobs": None}]
    last = chunk(job, "m", [], usage(3, 1))
    assert last["choices"] == [] and last["usage"]["total_tokens"] == 4
    lp = chunk_choice(job, c, text="q", entries=[(113, -0.7, [(113, -0.7)])], offset=5)
    assert lp["logprobs"] == {
        "tokens": ["q"],
        "token_logprobs": [-0.7],
        "top_logprobs": [{"q": -0.7}],
        "text_offset": [5],
    }


def test_job_ids_are_unique_and_kept_when_given():
    jobs = [Job("text", [[1]], 1, SamplingParams(), None, ()) for _ in range(20)]
    assert len({j.id for j in jobs}) == 20
    fixed = Job("chat", [[1]], 1, SamplingParams(), None, (), id="chatcmpl-fixed", created=123)
    assert (fixed.id, fixed.created) == ("chatcmpl-fixed", 123)
