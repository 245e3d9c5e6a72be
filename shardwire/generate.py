"""`shardwire generate`: load a model, continue one prompt, print it as it is produced."""
from __future__ import annotations

import argparse
import sys

from .coordinator.launch import build_pipeline
from .devices import set_threads
from .engine import Engine, Request
from .formats import open_model
from .sampling import SamplingParams
from .tokenizer import load_tokenizer


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repeat_penalty=args.repeat_penalty, repeat_last_n=args.repeat_last_n,
                          seed=args.seed)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(rendered, add_special=False, parse_special=True)
    return tokenizer.encode(text)


def run_generate(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    model = open_model(args.model)
    tokenizer = load_tokenizer(model)
    prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    pipeline, _ = build_pipeline(model, args)
    engine = Engine(pipeline, tokenizer)
    try:
        handle = engine.submit(Request(prompt, sampling_from_args(args), max_tokens=args.n_predict,
                                       stop=tuple(args.stop), ignore_eos=args.ignore_eos))
        if not args.chat:
            sys.stdout.write(args.prompt)
        for event in handle:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        if handle.error:
            print(f"shardwire: error: {handle.error}", file=sys.stderr)
            return 1
        s = handle.stats
        print(f"prompt: {s.prompt_tokens} tokens, {s.prompt_tps:.1f} tokens/s | "
              f"generation: {s.completion_tokens} tokens, {s.decode_tps:.1f} tokens/s", file=sys.stderr)
        return 0
    finally:
        engine.close()
        pipeline.close()
