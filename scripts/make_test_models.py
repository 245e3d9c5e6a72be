#!/usr/bin/env python3
"""Write the synthetic test models (and optionally glassllm) to a folder.

    python scripts/make_test_models.py OUT_DIR [--arch llama,qwen2] [--types F32,Q4_K] [--no-hf] [--glassllm]

For each model (llama, llama3.1, mistral, qwen2, qwen3): NAME-TYPE.gguf per type and the Hugging
Face folder NAME-hf with the same weights, each with the vocabulary its real models use.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from shardwire_kit.synthetic import TEST_MODELS, write_test_model
from shardwire_kit.writer import WEIGHT_TYPES


def csv(choices):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        bad = [t for t in items if t not in choices]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown: {', '.join(bad)} (choose from {', '.join(choices)})")
        return items

    return parse


def describe(path: Path) -> str:
    """Size and tensor types, e.g. '11.3 MB  Q4_K x30, F32 x9' (a Q4_K request on rows that are not
    whole 256-blocks gives F16)."""
    from collections import Counter

    from shardwire.formats import open_model

    size = sum(p.stat().st_size for p in path.rglob("*")) if path.is_dir() else path.stat().st_size
    types = Counter(t.dtype for t in open_model(path).tensors.values())
    return f"{size / 1e6:.1f} MB  " + ", ".join(f"{t} x{n}" for t, n in types.most_common())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument(
        "--arch",
        type=csv(list(TEST_MODELS)),
        default=list(TEST_MODELS),
        help=f"models to write (default: all of {','.join(TEST_MODELS)})",
    )
    parser.add_argument(
        "--types",
        type=csv(WEIGHT_TYPES),
        default=["F32", "F16", "Q8_0", "Q4_0", "Q4_K"],
        help="GGUF weight types (default: F32,F16,Q8_0,Q4_0,Q4_K)",
    )
    parser.add_argument(
        "--hf",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also write the Hugging Face folder (default: yes)",
    )
    parser.add_argument("--glassllm", action="store_true", help="also convert glassllm's trained model")
    args = parser.parse_args(argv)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for name in args.arch:
        start = time.perf_counter()
        paths = write_test_model(args.out_dir, name, args.types, hf=args.hf)
        for path in paths.values():
            print(f"{path}  {describe(path)}")
        print(f"  {name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
    if args.glassllm:
        from shardwire_kit.glassllm import convert_glassllm

        for path in (
            convert_glassllm(args.out_dir / "glassllm-en-F16.gguf", "gguf"),
            convert_glassllm(args.out_dir / "glassllm-en-hf", "hf"),
        ):
            print(f"{path}  {describe(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
