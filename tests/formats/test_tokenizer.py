import inspect
import json
import time
from functools import lru_cache
from types import SimpleNamespace

import pytest

from shardwire.formats.gguf import read_gguf
from shardwire.tokenizer import Tokenizer, TokenizerError, load_tokenizer, tokenizer_from_gguf, tokenizer_from_hf_folder
from shardwire.tokenizer.hf import HFTokenizer

from paths import shared_path

VOCABS = ["llama-spm", "llama-bpe", "qwen2", "phi-3", "gpt-2"]
MULTIBYTE = [
    "🦙 llamas 🦙🦙 and 👍🏽",
    "中文字符测试，日本語のテキスト、한국어",
    "Äpfel für Ünsere Öfen — ½ €",
    "mixed 🚀中 é\u0301 ا لعربية",
]


@lru_cache(maxsize=None)
def _metadata(name: str) -> dict:
    return read_gguf(shared_path("vocab", f"ggml-vocab-{name}.gguf")).metadata


def vocab(name: str) -> Tokenizer:
    return tokenizer_from_gguf(_metadata(name))


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """The pairs llama.cpp's tests/test-tokenizer-0 reads: the .inp file split on
    "\\n__ggml_vocab_test__\\n" (so a piece keeps no trailing newline of its own, and the file's
    final separator leaves no empty piece), and one .out line of ids per piece."""
    raw = shared_path("vocab", f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    sep = "\n__ggml_vocab_test__\n"
    pieces, pos = [], 0
    while pos < len(raw):
        end = raw.find(sep, pos)
        if end < 0:
            pieces.append(raw[pos:])
            break
        pieces.append(raw[pos:end])
        pos = end + len(sep)
    lines = shared_path("vocab", f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").splitlines()
    assert len(lines) == len(pieces)
    return [(text, [int(t) for t in line.split()]) for text, line in zip(pieces, lines)]


@pytest.mark.parametrize("name", VOCABS)
def test_llama_cpp_test_vectors(name):
    tok = vocab(name)
    cases = vocab_cases(name)
    assert len(cases) >= 40
    wrong = [
        (text, tok.encode(text, add_special=False), ids)
        for text, ids in cases
        if tok.encode(text, add_special=False, parse_special=False) != ids
    ]
    assert not wrong, "\n".join(f"{t!r}: got {g}, llama.cpp {w}" for t, g, w in wrong)


@pytest.mark.parametrize("name", VOCABS)
def test_decode_round_trips(name):
    tok = vocab(name)
    for text, ids in vocab_cases(name):
        if any(p in text for p in (" ?", " !", " .", " ,", " '")):
            continue  # llama.cpp's clean-up of those spaces is tested below
        assert tok.decode(ids) == text, repr(text)


def test_clean_spaces_as_llama_cpp():
    text = "Hello , world ! It 's here . Isn 't it ?"
    assert vocab("llama-bpe").decode(vocab("llama-bpe").encode(text)) == "Hello, world! It's here. Isn 't it?"
    assert vocab("gpt-2").decode(vocab("gpt-2").encode(text)) == "Hello, world! It's here. Isn 't it?"
    assert vocab("qwen2").decode(vocab("qwen2").encode(text)) == text  # qwen2 keeps them


def test_spm_space_prefix():
    tok = vocab("llama-spm")
    assert tok.encode("Hello", add_special=False) == [15043]  # "▁Hello"
    assert tok.decode([15043]) == "Hello"
    # with a leading BOS llama.cpp keeps the prefixed space
    assert tok.decode(tok.encode("Hello")) == " Hello"
    assert tok.decode(tok.encode("Hello"), skip_special=False) == "<s> Hello"
    # a special token restarts the prefix
    assert tok.encode("<s>Hello", add_special=False, parse_special=True) == [1, 15043]


@pytest.mark.parametrize(
    "name,add_bos,bos",
    [
        ("llama-spm", True, 1),
        ("phi-3", True, 1),
        ("llama-bpe", True, 128000),
        ("qwen2", False, 151643),
        ("gpt-2", False, 50256),
    ],
)
def test_bos_eos(name, add_bos, bos):
    tok = vocab(name)
    assert (tok.add_bos, tok.bos_id, tok.add_eos) == (add_bos, bos, False)
    plain = tok.encode("Hello world", add_special=False)
    assert tok.encode("Hello world") == ([bos] if add_bos else []) + plain
    assert tok.encode("", add_special=False) == []


def test_add_eos_from_metadata():
    md = dict(_metadata("llama-spm"), **{"tokenizer.ggml.add_eos_token": True})
    tok = tokenizer_from_gguf(md)
    assert tok.encode("Hi")[0] == 1 and tok.encode("Hi")[-1] == 2
    assert tok.decode(tok.encode("Hi")) == " Hi"


def test_stop_ids():
    llama3 = vocab("llama-bpe")
    assert llama3.eos_id == 128001
    assert {128001, llama3.encode("<|eot_id|>", add_special=False, parse_special=True)[0]} <= llama3.stop_ids
    assert 128009 in llama3.stop_ids  # <|eot_id|>
    qwen = vocab("qwen2")
    im_end, endoftext = qwen.encode("<|im_end|><|endoftext|>", add_special=False, parse_special=True)
    assert {im_end, endoftext} <= qwen.stop_ids and qwen.eos_id == endoftext
    assert 32007 in vocab("phi-3").stop_ids  # <|end|>
    assert vocab("llama-spm").stop_ids == {2}


def test_parse_special():
    tok = vocab("qwen2")
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special=False, parse_special=True)
    assert ids[0] == 151644 and ids[-1] == 151645
    assert tok.decode(ids[1:-1]) == "user\nhi"
    assert tok.decode(ids, skip_special=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.decode(ids) == "user\nhi"
    plain = tok.encode("<|im_start|>user", add_special=False)
    assert 151644 not in plain and tok.decode(plain) == "<|im_start|>user"


def test_phi3_special_tokens_strip_following_whitespace():
    # llama.cpp marks Phi-3's special tokens rstrip (by the model name), as its tokenizer.json does
    tok = vocab("phi-3")
    assert tok.encode("<|user|>\n  Hi", add_special=False, parse_special=True) == tok.encode(
        "<|user|>Hi", add_special=False, parse_special=True
    )


@pytest.mark.parametrize("name", VOCABS)
@pytest.mark.parametrize("text", MULTIBYTE)
def test_stream_decoder(name, text):
    tok = vocab(name)
    for ids in (tok.encode(text, add_special=False), tok.encode(text)):
        stream = tok.stream_decoder()
        chunks = [stream.feed(i) for i in ids]
        chunks.append(stream.flush())
        assert "".join(chunks) == tok.decode(ids)
        assert not any("\ufffd" in c for c in chunks)  # never half a character
    if name in ("llama-spm", "phi-3", "llama-bpe", "gpt-2"):
        assert "" in chunks[:-1]  # some character was split across tokens and held back


def test_stream_decoder_holds_back_clean_up():
    tok = vocab("llama-bpe")
    ids = tok.encode("Hello , world ! It 's  ok '")
    stream = tok.stream_decoder()
    assert "".join([stream.feed(i) for i in ids] + [stream.flush()]) == tok.decode(ids)


def test_token_text():
    assert vocab("llama-spm").token_text(15043) == " Hello"
    assert vocab("qwen2").token_text(151644) == "<|im_start|>"
    assert vocab("llama-bpe").token_text(9906) == "Hello"


def test_encode_speed():
    # ~4000 tokens of varied English prose and code, on a fresh tokenizer (empty word cache)
    import argparse
    import collections
    import email
    import json as json_module
    import textwrap
    import typing

    text = "\n\n".join(inspect.getdoc(m) for m in (argparse, collections, email, json_module, typing))
    text += inspect.getsource(textwrap)
    for name in ("llama-bpe", "llama-spm"):
        tok = vocab(name)
        start = time.perf_counter()
        ids = tok.encode(text[:17000])
        assert len(ids) > 3500 and time.perf_counter() - start < 1.0


def test_errors():
    md = dict(_metadata("gpt-2"))
    with pytest.raises(TokenizerError, match="'rwkv-world'"):
        tokenizer_from_gguf(dict(md, **{"tokenizer.ggml.model": "rwkv-world"}))
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        tokenizer_from_gguf({"general.architecture": "llama"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.tokens"):
        tokenizer_from_gguf({"tokenizer.ggml.model": "gpt2"})
    with pytest.raises(TokenizerError, match="'no-such-pre'"):
        tokenizer_from_gguf(dict(md, **{"tokenizer.ggml.pre": "no-such-pre"}))
    tok = vocab("gpt-2")
    for bad in ([50257], [-1], [1, 2, 10**9]):
        with pytest.raises(TokenizerError, match="out of range"):
            tok.decode(bad)
    with pytest.raises(TokenizerError):
        tok.stream_decoder().feed(50257)
    assert issubclass(TokenizerError, ValueError)


def test_missing_pre_is_default():
    md = {k: v for k, v in _metadata("gpt-2").items() if k != "tokenizer.ggml.pre"}
    tok = tokenizer_from_gguf(md)
    # llama.cpp's default splits digits in threes and punctuation runs apart
    assert [tok.decode([i]) for i in tok.encode("x1234567", add_special=False)] == ["x", "123", "456", "7"]


def test_load_tokenizer_from_model_file():
    tok = load_tokenizer(SimpleNamespace(format="gguf", metadata=_metadata("qwen2"), path="x.gguf"))
    assert tok.vocab_size == 151936 and tok.chat_template


# --- tokenizer.json through the tokenizers library ---


def _trained_byte_level_tokenizer():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(["hello world, the quick brown fox", "tokenizers are fun"] * 20, trainer)
    hf.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    return hf


def test_hf_folder(tmp_path):
    hf = _trained_byte_level_tokenizer()
    hf.save(str(tmp_path / "tokenizer.json"))
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": template})
    )
    tok = tokenizer_from_hf_folder(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.add_bos, tok.add_eos) == (0, 1, True, False)
    assert tok.chat_template == template and {1, 3} <= tok.stop_ids
    for text in ["hello world", "the quick brown fox 🦙 über", *MULTIBYTE]:
        ids = tok.encode(text)
        assert ids[0] == 0 and ids[1:] == hf.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
        stream = tok.stream_decoder()
        assert "".join([stream.feed(i) for i in ids] + [stream.flush()]) == text
    special = tok.encode("<|im_start|>hi<|im_end|>", add_special=False, parse_special=True)
    assert special[0] == 2 and special[-1] == 3
    plain = tok.encode("<|im_start|>hi", add_special=False)
    assert 2 not in plain and tok.decode(plain) == "<|im_start|>hi"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|im_start|>user\nhi<|im_end|>\n"
    with pytest.raises(TokenizerError, match="out of range"):
        tok.decode([tok.vocab_size])
    assert load_tokenizer(SimpleNamespace(format="hf", path=tmp_path, metadata={})).vocab_size == tok.vocab_size


def test_hf_folder_without_tokenizer_json(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        tokenizer_from_hf_folder(tmp_path)


def test_gguf_metadata_with_huggingface_json():
    # a character-level BPE, as shardwire's converter writes for its small trained model
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models

    chars = ["<s>", "</s>", *"abcdefghijklmnopqrstuvwxyz ,.!", "ab", "abc"]
    hf = HFTokenizer(models.BPE({c: i for i, c in enumerate(chars)}, [("a", "b"), ("ab", "c")]))
    hf.decoder = decoders.Fuse()
    hf.add_special_tokens(["<s>", "</s>"])
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.huggingface.json": hf.to_str(),
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": "{{ messages[0]['content'] }}",
    }
    tok = tokenizer_from_gguf(md)
    ids = tok.encode("abc cab, ab!")
    assert ids == [0, *hf.encode("abc cab, ab!", add_special_tokens=False).ids]
    assert chars.index("abc") in ids and tok.decode(ids) == "abc cab, ab!"
    assert tok.stop_ids == {1} and tok.vocab_size == len(chars)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


def test_a_continuation_keeps_the_space_before_its_first_word():
    spm = vocab("llama-spm")
    prompt, reply = spm.encode("The capital of France is"), spm.encode("Paris, of course", add_special=False)
    stream = spm.stream_decoder(after=prompt)
    assert "".join([stream.feed(i) for i in reply] + [stream.flush()]) == " Paris, of course"
    assert spm.decode(reply) == "Paris, of course"  # a text of its own starts without it

    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers

    raw = Raw(models.WordLevel({"<s>": 0, "▁The": 1, "▁capital": 2, "▁Paris": 3, "[UNK]": 4}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    hf = HFTokenizer(raw, bos_id=0, eos_id=None, add_bos=True, add_eos=False, chat_template=None)
    stream = hf.stream_decoder(after=[0, 1, 2])
    assert stream.feed(3) + stream.flush() == " Paris" and hf.decode([3]) == "Paris"


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_a_stream_shows_the_special_tokens_it_is_told_to_keep_and_skips_the_rest(form, tmp_path):
    """llama-server's preserved tokens: the marks a reply's reasoning and calls are read apart by
    show as text though special; every other special token is skipped as before."""
    if form == "gguf":
        tok = vocab("qwen2")
    else:
        _trained_byte_level_tokenizer().save(str(tmp_path / "tokenizer.json"))
        tok = tokenizer_from_hf_folder(tmp_path)
    ids = tok.encode("<|im_start|>hello<|im_end|>", add_special=False, parse_special=True)
    start, end = ids[0], ids[-1]

    def streamed(kept):
        stream = tok.stream_decoder(kept=kept)
        return "".join([stream.feed(i) for i in ids] + [stream.flush()])

    assert streamed(frozenset()) == "hello"
    assert streamed(frozenset({start})) == "<|im_start|>hello"
    assert streamed(frozenset({start, end})) == "<|im_start|>hello<|im_end|>"


def _with_pre(name: str, pre: str, path):
    """The shared vocabulary `name` written again with tokenizer.ggml.pre set to `pre`."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(shared_path("vocab", f"ggml-vocab-{name}.gguf"))
    writer = GGUFWriter(str(path), arch=reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value = pre if field.name == "tokenizer.ggml.pre" else field.contents()
        kind = field.types[0]
        writer.add_key_value(field.name, value, kind, field.types[-1] if kind == GGUFValueType.ARRAY else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# the pre-tokenizers of the big-MoE families' files (DeepSeek-V3/R1/V3.1, DeepSeek-V2, GLM-4.5 and
# GLM-4, gpt-oss, Kimi K2), which llama.cpp's own test vocabularies do not include
@pytest.mark.parametrize("pre", ["deepseek-v3", "deepseek-llm", "glm4", "chatglm-bpe", "gpt-4o", "kimi-k2"])
def test_the_big_moe_files_pre_tokenizers_split_text_as_llama_cpp_does(pre, tmp_path):
    """GPT-2's vocabulary under each pre-tokenizer, encoding every test text of llama.cpp's
    vocabularies (and MULTIBYTE) as llama.cpp encodes it."""
    numerics = pytest.importorskip("benchmarks.numerics_llamacpp")
    if reason := numerics.unavailable():
        pytest.skip(reason)
    theirs = numerics.llama_cpp().Llama(
        model_path=str(_with_pre("gpt-2", pre, tmp_path / f"{pre}.gguf")), vocab_only=True, verbose=False
    )
    ours = tokenizer_from_gguf({**_metadata("gpt-2"), "tokenizer.ggml.pre": pre})
    texts = [text for name in VOCABS for text, _ in vocab_cases(name)] + MULTIBYTE
    for text in texts:
        assert ours.encode(text, add_special=False) == theirs.tokenize(text.encode(), add_bos=False, special=False), (
            text
        )
