import json
from functools import lru_cache

import pytest

from shardwire.formats.gguf import read_gguf
from shardwire.serving.chat import CHATML_TEMPLATE, ChatTemplateError, render_chat
from shardwire.serving.chat_templates import BUILTIN
from shardwire.tokenizer import tokenizer_from_gguf

from paths import shared_path

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Exercises what transformers adds to plain Jinja: trim/lstrip blocks, loop controls, tojson with
# options, strftime_now, namespace, {% generation %}, dropped None keys and reasoning aliases.
KITCHEN_SINK_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(count=0) %}
{% if tools %}Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% if message['role'] == 'skip' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message['role'] == 'assistant' %}
[{{ message['role'] }}]{% generation %}{{ message.get('reasoning_content', '') }}|{{ message['content'] }}{% endgeneration %}{{ eos_token }}
    {% else %}
[{{ message['role'] }}] {{ message['content'] | tojson }} {{ 'tool_calls' in message }} {{ message | tojson(sort_keys=True) }}
    {% endif %}
{% endfor %}
count={{ ns.count }} year={{ strftime_now('%Y') }} flag={{ custom_flag | default('unset') }}
{% if add_generation_prompt %}[assistant]{% endif %}"""

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": 'Hi "there" — café <b>'},
    {"role": "assistant", "content": "Hello!", "reasoning": "greet back", "tool_calls": None},
    {"role": "skip", "content": "not shown"},
    {"role": "user", "content": "  And now?  "},
    {"role": "stop", "content": "end"},
    {"role": "user", "content": "after stop"},
]


@lru_cache(maxsize=None)
def _metadata(name: str) -> dict:
    return read_gguf(shared_path("vocab", f"ggml-vocab-{name}.gguf")).metadata


def transformers_render(template, messages, add_generation_prompt, bos_token="<s>", eos_token="</s>", **kwargs):
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast

    hf = HFTokenizer(models.WordLevel({bos_token: 0, eos_token: 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok = PreTrainedTokenizerFast(tokenizer_object=hf, bos_token=bos_token, eos_token=eos_token)
    return tok.apply_chat_template(
        messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
    )


def gguf_template(name: str) -> str:
    template = _metadata(name).get("tokenizer.chat_template")
    if template is None:
        pytest.skip(f"{name} vocabulary carries no chat template")
    return template


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("source", ["qwen2", "phi-3", "llama3", "chatml", "kitchen-sink"])
def test_matches_transformers(source, add_generation_prompt):
    template = {"llama3": LLAMA3_TEMPLATE, "chatml": CHATML_TEMPLATE, "kitchen-sink": KITCHEN_SINK_TEMPLATE}.get(
        source
    ) or gguf_template(source)
    messages = (
        MESSAGES
        if source == "kitchen-sink"
        else [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi ü 🦙"},
            {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "  Bye\n"},
        ]
    )
    if source == "qwen2":
        messages = messages[1:]  # also exercise its default system prompt
    extra = (
        {"tools": [{"name": "get_weather", "parameters": {"city": "string"}}], "custom_flag": "on"}
        if source == "kitchen-sink"
        else {}
    )
    ours = render_chat(
        template, messages, add_generation_prompt=add_generation_prompt, bos_token="<s>", eos_token="</s>", **extra
    )
    assert ours == transformers_render(template, messages, add_generation_prompt, **extra)


def test_qwen2_vocab_template_and_tokens():
    tok = tokenizer_from_gguf(_metadata("qwen2"))
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.encode(prompt, add_special=False, parse_special=True)
    assert ids.count(151644) == 3 and ids.count(151645) == 2 and ids[-1] != 151645


def test_chatml_fallback():
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [{"type": "text", "text": "yo"}]}]
    assert render_chat(None, messages) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render_chat(None, messages[:1], add_generation_prompt=False) == "<|im_start|>user\nhi<|im_end|>\n"
    md = {k: v for k, v in _metadata("gpt-2").items() if k != "tokenizer.chat_template"}
    assert tokenizer_from_gguf(md).apply_chat_template(messages[:1]) == render_chat(None, messages[:1])


def test_broken_templates():
    with pytest.raises(ChatTemplateError, match="does not parse"):
        render_chat("{% for m in messages %}{{ m['content'] }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat("{{ raise_exception('roles must alternate') }}", [])
    with pytest.raises(ChatTemplateError, match="TypeError"):
        render_chat("{{ messages[0]['content'] + 1 }}", [{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses Python internals
        render_chat("{{ messages.__class__.__mro__ }}", [])
    assert issubclass(ChatTemplateError, ValueError)


def test_templates_see_todays_date_as_llama_cpp_names_it():
    from datetime import date

    text = render_chat("{{ date_string }} | {{ 'Today is ' + datetime }}", [{"role": "user", "content": "Hi"}])
    today = date.today()
    assert text == f"{today.strftime('%d %b %Y')} | Today is {today.strftime('%b %d %Y')}"


def test_templates_see_the_tools_as_functions_text_as_firefunction_reads_them():
    template = "{{ 'Functions:\\n' + functions }}"
    assert render_chat(template, [{"role": "user", "content": "Hi"}]) == "Functions:\n"
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    text = render_chat(template, [{"role": "user", "content": "Hi"}], tools=[tool])
    assert json.loads(text.removeprefix("Functions:\n")) == [tool]


class _Llama3:
    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        return render_chat(BUILTIN["llama3"], messages, add_generation_prompt=add_generation_prompt, **extra)


def test_a_last_assistant_message_is_a_prefill_the_reply_continues():
    from shardwire.serving.openai_api import APIError, chat_text

    asked = [{"role": "user", "content": "What is the best book"}]
    head = "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>"
    head += "<|start_header_id|>assistant<|end_header_id|>\n\n"
    prefill = asked + [{"role": "assistant", "content": "Whill"}]
    assert chat_text(_Llama3(), asked, {}).endswith(head)
    assert chat_text(_Llama3(), prefill, {}).endswith(head + "Whill")
    explicit = {"continue_final_message": True, "add_generation_prompt": False}
    assert chat_text(_Llama3(), prefill, explicit) == chat_text(_Llama3(), prefill, {})
    assert chat_text(_Llama3(), asked + [{"role": "assistant", "content": ""}], {}).endswith(head)
    for messages, body in [
        (prefill, {"continue_final_message": True}),  # and a generation prompt (the default)
        (asked, {"continue_final_message": True, "add_generation_prompt": False}),  # nothing to continue
        (prefill + [{"role": "assistant", "content": "x"}], {}),  # two assistant turns at the end
        (asked, {"add_generation_prompt": "yes"}),
    ]:
        with pytest.raises(APIError) as e:
            chat_text(_Llama3(), messages, body)
        assert e.value.status == 400


# the chat templates of the big-MoE files, as llama.cpp's tests keep them, and what each writes for
# a call in the history
CALLS_WRITTEN = {
    "GLM-4.6": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n</tool_call>",
    "Kimi-K2-Instruct": '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}',
    "Kimi-K2-Thinking": '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Rome"}',
    "deepseek-ai-DeepSeek-V3.1": '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>',
    "deepseek-ai-DeepSeek-V3.2": '<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>',
    "llama-cpp-deepseek-r1": '<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```',
    "openai-gpt-oss-120b": 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Rome"}<|call|>',
}


@pytest.mark.parametrize("name", sorted(CALLS_WRITTEN))
def test_the_big_moe_templates_render_a_history_with_a_call_its_result_and_reasoning(name):
    """Through the API's own preparation of the history (arguments as objects): Kimi K2's template
    grows a list of ids (append), DeepSeek-V3.2's reads arguments with from_json, R1's writes
    tools | map(...) | tojson, llama.cpp's engine allows all three."""
    convert = pytest.importorskip("shardwire_kit.convert")
    from shardwire.serving.tools import history_message

    from tool_calls import WEATHER

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 20}'},
        {"role": "user", "content": "Thanks"},
    ]
    history = [history_message(m, f"messages[{i}]") for i, m in enumerate(messages)]
    before = json.dumps(history)
    prompt = render_chat(convert.chat_template(name), history, tools=[WEATHER], bos_token="<s>", eos_token="</s>")
    result = ('{"temp": 20}', json.dumps('{"temp": 20}'))  # gpt-oss's writes a result as a JSON string
    assert CALLS_WRITTEN[name] in prompt and any(r in prompt for r in result) and prompt.count("Thanks") == 1
    assert json.dumps(history) == before  # what a template changes is its own copy
