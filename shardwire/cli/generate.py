"""`shardwire generate`: load a model, continue one prompt, print it as it is produced."""

from __future__ import annotations

import argparse
import sys

from ..coordinator.launch import build_pipeline, load_draft
from ..devices import set_threads
from ..engine import Engine, Handle, Request
from ..engine.drafting import Speculation
from ..formats import open_model
from ..sampling import SamplingParams
from ..tokenizer import load_tokenizer


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        seed=args.seed,
    )


def speculation_from_args(args: argparse.Namespace) -> Speculation | None:
    """What the speculative flags ask of every request (llama-server's: -md alone means draft-simple)."""
    kind = args.spec_type or ("draft-simple" if args.model_draft else "none")
    if kind == "none":
        return None
    if kind == "draft-simple" and not args.model_draft:
        raise ValueError("--spec-type draft-simple needs a draft model: -md FILE")
    return Speculation(kind, args.draft_max, args.draft_min, args.spec_ngram_size_n, args.draft_p_min)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    if chat:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}])
        return tokenizer.encode(rendered, add_special=False, parse_special=True)
    return tokenizer.encode(text)


def stream(handle: Handle, text: str) -> None:
    """Print `text`, then the continuation as it is produced."""
    sys.stdout.write(text)
    for event in handle:
        sys.stdout.write(event.text)
        sys.stdout.flush()
    sys.stdout.write("\n")


def speeds(handle: Handle) -> str:
    s = handle.stats
    return (
        f"prompt: {s.prompt_tokens} tokens at {s.prompt_tps:.0f} tokens/s | "
        f"generation: {s.completion_tokens} tokens at {s.decode_tps:.1f} tokens/s"
    )


def run_generate(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    model = open_model(args.model)
    tokenizer = load_tokenizer(model)
    prompt = encode_prompt(tokenizer, args.prompt, args.chat)
    speculation = speculation_from_args(args)
    draft = load_draft(args, tokenizer, 1, min(args.ctx_size, model.config.context_length))  # before any weight ships
    pipeline, _ = build_pipeline(model, args)
    engine = Engine(pipeline, tokenizer, draft=draft, ahead=args.spec_ahead)
    try:
        handle = engine.submit(
            Request(
                prompt,
                sampling_from_args(args),
                max_tokens=args.n_predict,
                stop=tuple(args.stop),
                ignore_eos=args.ignore_eos,
                speculation=speculation,
            )
        )
        stream(handle, "" if args.chat else args.prompt)
        if handle.error:
            print(f"shardwire: error: {handle.error}", file=sys.stderr)
            return 1
        print(speeds(handle), file=sys.stderr)
        return 0
    finally:
        engine.close()
        pipeline.close()
