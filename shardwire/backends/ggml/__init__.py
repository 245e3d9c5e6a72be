"""The ggml backend: a stage's blocks as ggml graphs on a CPU in float32 (block.py, deltanet.py,
graph.py), which blocks they take, and the stage's one-graph decode step.

The graphs implement the block variants in IMPLEMENTED and nothing else. A block of another
variant (another activation, norms after the mixer, RoPE of a local base, a field of BlockVariant
this table has not heard of) is refused with a log line and runs on the PyTorch modules, which
implement every variant the families declare: a family the graphs do not know computes slower,
never differently."""

from __future__ import annotations

import logging
from dataclasses import fields

import torch

from ...model import LatentAttention, rope_gain
from ...models import BlockVariant
from .block import BlockGraphs, FeedForwardGraphs, StageGraph
from .deltanet import DeltaNetGraphs
from .graph import in_scratch, release_graph_memory
from .latent import LatentGraphs, choose_form, choose_widening

log = logging.getLogger("shardwire.ggml")

# BlockVariant field -> the values the graphs compute
IMPLEMENTED = {
    "mixer": ("attention", "gated_attention", "gated_delta_net", "latent_attention"),
    "qk_norm": (False, True),
    "ffn": ("dense", "experts"),
    "activation": ("silu", "clamped_swiglu"),
    "routing": (
        "",
        "softmax_top_k",
        "softmax_top_k_normalized",
        "top_k_softmax",
        "sigmoid_biased_top_k",
        "sigmoid_biased_top_k_normalized",
    ),
    "shared_expert": ("", "sigmoid_gated", "plain"),
    "post_norms": (False,),
    "window": range(1 << 31),
    "local_rope": (False,),
    "query_scale": (0.0,),
    "sinks": (False, True),
}


def refusal(variant: BlockVariant) -> str | None:
    """Why the graphs do not run blocks of `variant`; None where they do."""
    lacking = [
        f"{f.name}={getattr(variant, f.name)!r}"
        for f in fields(variant)
        if getattr(variant, f.name) not in IMPLEMENTED.get(f.name, ())
    ]
    return f"ggml's graphs do not implement {', '.join(lacking)}" if lacking else None


def applies(stage) -> bool:
    return stage.device.type == "cpu" and stage.dtype == torch.float32


def borrowed(x: torch.Tensor) -> bool:
    return in_scratch(x)


def release() -> None:
    release_graph_memory()


def attach(stage) -> None:
    """Give each block of `stage` (float32, on the CPU) its graphs where ggml implements its variant
    and can run its weights as held, and the stage its decode graph where every block has them."""
    refused, stage.choices = {}, []
    for i, block in zip(range(stage.start, stage.end), stage.blocks):
        why = refusal(block.variant)
        if why is not None:
            refused.setdefault((block.variant, why), []).append(i)
            continue
        graphs = LatentGraphs if isinstance(block.attn, LatentAttention) else BlockGraphs
        block.runner = graphs.of(block, stage.inv_freq, stage.cfg.rope_theta, rope_gain(stage.cfg))
        if block.runner is None and graphs is BlockGraphs:  # a token mixer they do not take: a delta-net's
            block.feed_runner = FeedForwardGraphs.of(block)
            block.runner = DeltaNetGraphs.of(block, block.feed_runner)
    for (variant, why), blocks in refused.items():
        log.info("blocks %s (%s) run on PyTorch's modules: %s", _ranges(blocks), variant, why)
    latent = {
        i: b.runner for i, b in zip(range(stage.start, stage.end), stage.blocks) if isinstance(b.runner, LatentGraphs)
    }
    if latent:  # measured here, on the thread that loads the stage: its graphs' memory is given back
        for chosen, times in filter(None, (choose_widening(list(latent.values())), choose_form(list(latent.values())))):
            stage.choices.append(chosen)
            log.info("blocks %s: %s (%s)", _ranges(list(latent)), chosen, times)
        release_graph_memory()
    cfg = stage.cfg
    if cfg.embedding_scale != 1.0 or cfg.logit_softcap:  # what the stage graph's embedding and head do not do
        return
    stage.runner = StageGraph.of(
        [block.runner for block in stage.blocks],
        *((stage.norm, stage.head) if stage.last else (None, None)),
        embed=stage.embed,
    )


def _ranges(blocks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], blocks[0]
    for prev, cur in zip(blocks, blocks[1:] + [None]):
        if cur != prev + 1:
            out.append(f"{start}-{prev}" if prev > start else str(start))
            start = cur
    return ", ".join(out)
