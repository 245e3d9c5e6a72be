"""Tiny models of a family taught to answer one chat request in the family's own format: by
thinking, then calling a tool (shardwire_kit.convert.teach), as llama.cpp's converter writes them.
The chat tests check what serve and llama-server return for them; the web page's test shows it.
`taught_models`: each made once per test run."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwire_kit import convert

from tool_calls import WEATHER

REASONING = "The user asks for the weather in Rome."
ASKED = {"messages": [{"role": "user", "content": "Weather in Rome?"}], "max_tokens": 80, "temperature": 0}
CALL = ("get_weather", {"city": "Rome"})
# each family's reply in its own format: its reasoning, then the call, then the token that ends it
REPLIES = {
    "glm4moe": (
        convert.tiny_glm4moe,
        f"<think>{REASONING}</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
        "</tool_call><|observation|>",
    ),
    "deepseek2": (  # R1's chat: the prompt opens the thinking
        convert.tiny_deepseek3,
        f"{REASONING}\n</think>\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
    ),
    "gpt-oss": (
        convert.tiny_gpt_oss,
        f"<|channel|>analysis<|message|>{REASONING}<|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city":"Rome"}<|call|>',
    ),
}


def asked() -> dict:
    """The request each taught model answers."""
    return {**ASKED, "tools": [WEATHER]}


def taught_model(family: str, folder: Path) -> Path:
    """The family's tiny model taught its reply to asked(), as the converter's float32 GGUF."""
    from shardwire.formats import open_model
    from shardwire.serving.openai_api import parse_chat
    from shardwire.tokenizer import load_tokenizer

    build, reply = REPLIES[family]
    hf = build(folder / "hf", layers=2)
    tokenizer = load_tokenizer(open_model(hf))
    prompt = parse_chat(asked(), tokenizer).prompts[0]
    convert.teach(hf, prompt, tokenizer.encode(reply, add_special=False, parse_special=True))
    return convert.convert(hf, folder / f"{family}.gguf")


@pytest.fixture(scope="session")
def taught_models(tmp_path_factory):
    """family -> its taught model, made once in a test run for every test that asks for it."""
    made: dict[str, Path] = {}

    def get(family: str) -> Path:
        if family not in made:
            made[family] = taught_model(family, tmp_path_factory.mktemp(family))
        return made[family]

    return get
