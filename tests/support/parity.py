"""A model on each backend this machine has, against transformers and against the reference path."""

from __future__ import annotations

import pytest
import torch

from shardwire import backends
from shardwire.backends import ggml as ggml_backend
from shardwire.engine import Engine, Request
from shardwire.formats import open_model
from shardwire.pipeline import LocalPipeline
from shardwire.pipeline.loading import load_stage
from shardwire.sampling import GREEDY
from shardwire.weights import ggml_cpu

from models import PROMPT

BACKENDS = ["reference", "ggml"]


def float32_stage(path, backend: str | None = None):
    """Every block in float32, its keys and values too (by default they are kept in float16,
    as llama.cpp keeps them), to compare with transformers' float32 to within rounding; on the
    `backend` given (None: whichever the stage chooses), the blocks' matrices held as it takes them."""
    model = open_model(path)
    if backend == "ggml":
        if not ggml_cpu.available():
            pytest.skip(f"no ggml here: {ggml_cpu.MISSING}")
        stored = {t.dtype: "ggml" for t in model.tensors.values()}
        stage = load_stage(model, 0, model.config.n_layers, weights="fast", fastest=stored)
        assert stage.backend is ggml_backend
        for block in stage.blocks:  # each block on ggml where it implements the block's variant
            assert (block.runner is not None) == (ggml_backend.refusal(block.variant) is None), block.variant
    else:
        stage = load_stage(model, 0, model.config.n_layers)
    if backend == "reference":
        backends.detach(stage)
    stage.kv_dtype = torch.float32
    return stage


def our_logits(path, ids, backend: str | None = None):
    stage = float32_stage(path, backend)
    stage.allocate_cache(1, 128)
    return stage(torch.tensor([ids]), [0], [0], all_logits=True)[0]


def greedy_tokens(path, ids, n, backend: str | None = None):
    pipeline = LocalPipeline([float32_stage(path, backend)], n_slots=1, ctx=128)
    engine = Engine(pipeline)
    try:
        handle = engine.submit(Request(ids, GREEDY, max_tokens=n))
        handle.result()
        return handle.tokens
    finally:
        engine.close()


def assert_graphs_give_the_modules_outputs(stage, chunks: tuple[int, ...] = (3,), bound: float = 2e-3) -> None:
    """stage_outputs with and without the graphs: within `bound` of the modules' largest value, and
    the same largest entry in every row."""
    with_graphs, without = stage_outputs(stage, True, chunks), stage_outputs(stage, False, chunks)
    for a, b in zip(with_graphs, without):
        assert float((a - b).abs().max()) <= bound * float(b.abs().max())
        assert torch.equal(a.argmax(-1), b.argmax(-1))


def stage_outputs(stage, use_graphs: bool, chunks: tuple[int, ...] = (3,)) -> list[torch.Tensor]:
    """Logits of a prompt read in chunks of these lengths, then decode steps of 2 sequences (the
    prompt's and a new one) and of 9 (more rows than the graphs take), with or without the blocks'
    graphs."""
    kept, kept_stage = [(b.runner, b.feed_runner) for b in stage.blocks], stage.runner
    if not use_graphs:
        stage.runner = None
        for b in stage.blocks:
            b.runner = b.feed_runner = None
    try:
        stage.allocate_cache(9, 32)
        out, n = [], 0
        for size in chunks:
            out.append(stage(torch.tensor([PROMPT[n : n + size]]), [0], [n]))
            n += size
        out.append(stage(torch.tensor([[PROMPT[n]], [PROMPT[n + 1]]]), [0, 1], [n, 0]))
        out.append(stage(torch.tensor([[t] for t in PROMPT[:9]]), list(range(9)), [n + 1, 1, 0, 0, 0, 0, 0, 0, 0]))
        return out
    finally:
        stage.runner = kept_stage
        for b, (graphs, feed) in zip(stage.blocks, kept):
            b.runner, b.feed_runner = graphs, feed


def decode_logits(stage) -> torch.Tensor:
    """A loaded stage's logits after each token of PROMPT, fed one at a time (the decode path: one
    row per product)."""
    stage.allocate_cache(1, 64)
    return torch.stack([stage(torch.tensor([[t]]), [0], [i])[0, -1].float() for i, t in enumerate(PROMPT)])


def assert_near_the_dense_logits(held: torch.Tensor, dense: torch.Tensor, within: float) -> None:
    """Logits of weights held as stored against those of the same weights dequantized: within
    `within` of the dense logits' mean spread, and the same top token wherever no error that large
    could change it. A wrongly wired type is off by the whole spread."""
    spread = float((dense.max(-1).values - dense.min(-1).values).mean())
    worst = float((held - dense).abs().max())
    assert worst < within * spread, (worst, spread)
    top2 = dense.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * worst
    assert torch.equal(held.argmax(-1)[clear], dense.argmax(-1)[clear])


def assert_decoded_as_ggml_decodes(info) -> None:
    """A tensor of the file (a TensorInfo) decodes to ggml's own dequantization, bit for bit."""
    import numpy as np

    from shardwire.weights import codecs

    raw = np.fromfile(info.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
    ours = codecs.to_torch(raw, info.dtype, info.shape).float()
    rows = torch.from_numpy(raw).view(info.shape[0], -1)
    ggmls = ggml_cpu.GGMLLinear(rows, info.dtype, info.shape[1], torch.float32).dequantize()
    assert torch.equal(ours.view(torch.int32), ggmls.view(torch.int32)), info.name
