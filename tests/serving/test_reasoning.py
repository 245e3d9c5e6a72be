"""Reasoning read apart from the answer, as llama-server returns it (reasoning_content)."""

import pytest

from shardwire.engine import Event
from shardwire.serving.chat import render_chat
from shardwire.serving.harmony import HarmonySplit
from shardwire.serving.openai_api import Choice, chat_text, chunk_choice, parse_chat, response, usage
from shardwire.serving.reasoning import HARMONY, ReasoningSplit

THINK = ("<think>", "</think>")
# the shapes of Qwen3's template (the block only when thinking is off) and DeepSeek-R1's (it
# always opens one)
QWEN3 = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)
R1 = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}{{ '<|assistant|><think>\\n' }}"


class Templated:
    def __init__(self, template):
        self.chat_template = template

    def apply_chat_template(self, messages, add_generation_prompt=True, **extra):
        return render_chat(self.chat_template, messages, add_generation_prompt=add_generation_prompt, **extra)

    def encode(self, text, add_special=True, parse_special=False):
        return [ord(c) for c in text]

    def token_text(self, token):
        return chr(token)


def split_all(pieces, inside=False, split=None):
    split, reasoning, answer = split or ReasoningSplit(THINK, inside), "", ""
    for piece in pieces:
        r, a = split.feed(piece)
        reasoning, answer = reasoning + r, answer + a
    r, a = split.flush()
    return reasoning + r, answer + a


@pytest.mark.parametrize(
    "pieces,inside,expected",
    [
        # the blank space around the reasoning dropped, as the whole reply's reasoning_content drops it
        (["<thi", "nk>\nI would", " say \n", "</th", "ink>\n\n", "Paris."], False, ("I would say", "Paris.")),
        (["<think>a \n", "b\n</think>c"], False, ("a \nb", "c")),  # held blank space inside it kept
        (["\n<think>a</think>b"], False, ("a", "b")),
        (["Paris, ", "<think> is", " text"], False, ("", "Paris, <think> is text")),  # no block at the start
        (["so", "me thought</think>", "Answer"], True, ("some thought", "Answer")),  # the prompt opened it
        (["thinking that never ends </thi"], True, ("thinking that never ends </thi", "")),
        (["<th"], False, ("", "<th")),
    ],
)
def test_streamed_text_splits_at_the_tags_wherever_the_pieces_break(pieces, inside, expected):
    assert split_all(pieces, inside) == expected
    assert split_all(list("".join(pieces)), inside) == expected  # one character at a time


def test_reasoning_off_renders_without_thinking_and_closes_a_block_the_template_opens():
    asked = [{"role": "user", "content": "What is today?"}]
    qwen3, r1 = Templated(QWEN3), Templated(R1)
    assert chat_text(qwen3, asked, {}).endswith("<|im_start|>assistant\n")
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert chat_text(qwen3, asked, off).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert chat_text(r1, asked, {}).endswith("<think>\n")
    assert chat_text(r1, asked, off).endswith("<think>\n</think>")


def test_a_chat_answer_carries_its_reasoning_apart_whole_and_streamed():
    job = parse_chat({"messages": [{"role": "user", "content": "Capital of France?"}]}, Templated(R1))
    assert job.reasoning == THINK and job.thinking  # R1's template opened the block
    whole, streamed = Choice(0, None, frozenset(), job), Choice(0, None, frozenset(), job)
    deltas = []
    for i, text in enumerate(["The capital", " is Paris.</th", "ink>\n\nParis", "."]):
        event = Event(text, finish_reason="stop" if i == 3 else None)
        whole.add(event)
        answer, _ = streamed.add(event)
        deltas.append(chunk_choice(job, streamed, text=answer, reasoning=streamed.new_reasoning)["delta"])
    message = response(job, "m", [whole], usage(1, 4))["choices"][0]["message"]
    assert message["content"] == "Paris." and message["reasoning_content"] == "The capital is Paris."
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The capital is Paris."
    assert "".join(d.get("content", "") for d in deltas) == "Paris."
    plain = parse_chat({"messages": [{"role": "user", "content": "Hi"}], "reasoning_format": "none"}, Templated(R1))
    assert plain.reasoning is None


def test_server_flags_become_template_variables_a_request_adds_to():
    from argparse import Namespace

    from shardwire.cli.serve import template_kwargs
    from shardwire.serving.state import ServerSettings

    kwargs = template_kwargs(Namespace(chat_template_kwargs='{"style": "brief"}', reasoning="off"))
    assert kwargs == {"style": "brief", "enable_thinking": False}
    settings = ServerSettings(chat_template_kwargs=kwargs)
    body = settings.with_defaults({"chat_template_kwargs": {"style": "long"}})
    assert body["chat_template_kwargs"] == {"style": "long", "enable_thinking": False}
    assert template_kwargs(Namespace(chat_template_kwargs=None, reasoning="auto")) == {"enable_thinking": True}
    assert template_kwargs(Namespace(chat_template_kwargs='{"enable_thinking": false}', reasoning="on")) == {
        "enable_thinking": False  # the explicit variable wins
    }
    for bad in ("{not json", "[1]"):
        with pytest.raises(ValueError, match="--chat-template-kwargs"):
            template_kwargs(Namespace(chat_template_kwargs=bad, reasoning="auto"))


@pytest.mark.parametrize("kwargs", [["enable_thinking"], {"messages": []}, {"add_generation_prompt": False}])
def test_template_variables_that_are_not_an_object_or_rename_the_templates_own_are_400s(kwargs):
    from shardwire.serving.openai_api import APIError

    with pytest.raises(APIError) as e:
        chat_text(Templated(QWEN3), [{"role": "user", "content": "Hi"}], {"chat_template_kwargs": kwargs})
    assert e.value.status == 400 and "chat_template_kwargs" in str(e.value)


def test_glm_s_template_thinks_by_default_and_its_reasoning_comes_apart():
    """GLM-4.5's own template: the reply opens its <think> block itself; with thinking off the
    template closes an empty one and asks /nothink."""
    convert = pytest.importorskip("shardwire_kit.convert")
    glm = Templated(convert.chat_template("GLM-4.6"))
    asked = [{"role": "user", "content": "Capital of France?"}]
    assert chat_text(glm, asked, {}).endswith("<|user|>\nCapital of France?<|assistant|>")
    off = chat_text(glm, asked, {"chat_template_kwargs": {"enable_thinking": False}})
    assert off.endswith("Capital of France?/nothink<|assistant|>\n<think></think>")
    job = parse_chat({"messages": asked}, glm)
    assert job.reasoning == THINK and not job.thinking  # the reply opens the block
    choice = Choice(0, None, frozenset(), job)
    choice.add(Event("\n<think>The capital is Paris.</think>\nParis.", finish_reason="stop"))
    message = response(job, "m", [choice], usage(1, 4))["choices"][0]["message"]
    assert message["content"] == "Paris." and message["reasoning_content"] == "The capital is Paris."


HARMONY_REPLY = (
    "<|channel|>analysis<|message|>The user asks for a capital.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Paris."
)


@pytest.mark.parametrize(
    "text,expected",
    [
        (HARMONY_REPLY, ("The user asks for a capital.", "Paris.")),
        ("<|channel|>final<|message|>Only an answer.", ("", "Only an answer.")),
        ("<|channel|>analysis<|message|>cut off mid-thou", ("cut off mid-thou", "")),
        ("Plain text, not harmony <|end|>", ("", "Plain text, not harmony <|end|>")),
        # a call: its recipient and arguments handed on in the form tools.py reads
        (
            "<|channel|>analysis<|message|>Needs the weather.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}',
            ("Needs the weather.", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Rome"}<|end|>'),
        ),
    ],
)
def test_harmony_s_analysis_channel_is_the_reasoning_wherever_the_pieces_break(text, expected):
    assert split_all([text], split=HarmonySplit()) == expected
    assert split_all(list(text), split=HarmonySplit()) == expected  # one character at a time


def test_gpt_oss_s_template_reads_as_harmony_and_its_reasoning_comes_apart():
    convert = pytest.importorskip("shardwire_kit.convert")
    oss = Templated(convert.chat_template("openai-gpt-oss-120b"))
    job = parse_chat({"messages": [{"role": "user", "content": "Capital of France?"}]}, oss)
    assert job.reasoning == HARMONY and not job.thinking
    assert chat_text(oss, [{"role": "user", "content": "Hi"}], {}).endswith("<|start|>assistant")
    choice = Choice(0, None, frozenset(), job)
    choice.add(Event(HARMONY_REPLY, finish_reason="stop"))
    message = response(job, "m", [choice], usage(1, 4))["choices"][0]["message"]
    assert message["content"] == "Paris." and message["reasoning_content"] == "The user asks for a capital."
