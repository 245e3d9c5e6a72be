"""The plan's arithmetic, without workers: how blocks are split, what a stage costs, and the
errors an impossible plan gives."""

import pytest
import torch

from shardwire.formats import open_model
from shardwire.kvcache import KVCache
from shardwire.pipeline.plan import (
    PlanDevice,
    PlanError,
    PlannedStage,
    make_plan,
    split_blocks,
    split_blocks_by_bytes,
    split_blocks_evenly,
    stage_cost,
)

from models import model_path


@pytest.mark.parametrize(
    "n,shares,expected",
    [
        (4, [1, 1], [2, 2]),
        (4, [3, 1], [3, 1]),
        (5, [1, 1], [3, 2]),  # llama.cpp gives the remainder to the earlier device
        (8, [1, 0, 1], [4, 0, 4]),
        (22, [3, 1, 1], [14, 4, 4]),
        (3, [1, 1, 1, 1], [1, 1, 1, 0]),  # more devices than blocks: the last ones get none
    ],
)
def test_split_blocks_follows_llama_cpp(n, shares, expected):
    assert split_blocks(n, shares) == expected


@pytest.mark.parametrize("shares", [[0, 0], [1, -1], []])
def test_split_blocks_refuses_bad_shares(shares):
    with pytest.raises(PlanError):
        split_blocks(4, shares)


def test_split_by_free_memory_rounds_by_largest_remainder():
    assert split_blocks_evenly(4, [100.0, 99.9]) == [2, 2]
    assert split_blocks_evenly(5, [1.0, 1.0, 3.0]) == [1, 1, 3]
    assert sum(split_blocks_evenly(22, [7.0, 3.0, 2.0])) == 22


def cpu_stage(start, end, first, last, dtype="float32", kernels=True):
    return PlannedStage(PlanDevice("w:1", "cpu", 1 << 40, dtype, kernels), start, end, first, last)


def test_stage_cost_counts_weights_kv_and_workspace():
    model = open_model(model_path("llama", "F32"))
    cfg = model.config
    tensors = model.stage_tensors(0, 2, True, False)
    cost = stage_cost(cfg, tensors, cpu_stage(0, 2, True, False), "dequant", n_slots=3, kv_pages=12, chunk=16)
    assert cost.weight_bytes == sum(t.nbytes for t in tensors.values())  # F32 held as it is stored
    # float32 compute keeps keys and values in float16, as llama.cpp does
    assert cost.kv_bytes == KVCache.nbytes_for(2, cfg.n_kv_heads, 12, cfg.head_dim, torch.float16)
    assert cost.workspace_bytes > 0 and cost.formats == {"F32": "dense"}
    assert cost.total_bytes == cost.weight_bytes + cost.kv_bytes + cost.workspace_bytes
    half = stage_cost(
        cfg, tensors, cpu_stage(0, 2, True, False, "bfloat16"), "dequant", n_slots=3, kv_pages=12, chunk=16
    )
    assert half.weight_bytes * 2 == cost.weight_bytes and half.kv_bytes == cost.kv_bytes


def test_stage_cost_follows_the_weight_mode_and_the_kernels():
    model = open_model(model_path("llama", "Q4_K"))
    tensors = model.stage_tensors(0, 4, True, True)

    def cost(weights, kernels=True):
        stage = cpu_stage(0, 4, True, True, kernels=kernels)
        return stage_cost(model.config, tensors, stage, weights, n_slots=1, kv_pages=4, chunk=16)

    dense, packed, compact = cost("dequant"), cost("packed"), cost("compact")
    assert packed.formats["Q4_K"].startswith("int4") and dense.formats["Q4_K"] == "dense"
    assert compact.weight_bytes <= packed.weight_bytes < dense.weight_bytes
    assert cost("packed", kernels=False).formats["Q4_K"] == "gguf"  # no int4 kernel: the stored blocks
    assert cost("fast", kernels=False).formats["Q4_K"] == "dense"
    with pytest.raises(ValueError, match="auto"):
        cost("auto")  # auto is the plan's to resolve, never a stage's


def test_make_plan_places_blocks_and_names_what_does_not_fit():
    model = open_model(model_path("llama", "F32"))
    devices = [PlanDevice("a:1", "cpu", 1 << 40), PlanDevice("b:1", "cpu", 1 << 40)]
    plan = make_plan(model, devices, tensor_split=[3, 1], ctx=64)
    assert [(s.start, s.end, s.first, s.last) for s in plan.stages] == [(0, 3, True, False), (3, 4, False, True)]
    plan.check_fits()
    tiny = [PlanDevice("a:1", "cpu", 1 << 40), PlanDevice("b:1", "cpu", 1 << 10)]
    with pytest.raises(PlanError, match=r"b:1/cpu needs .* short by"):
        make_plan(model, tiny, tensor_split=[1, 1], ctx=64).check_fits()
    with pytest.raises(PlanError, match="3 entries for 2"):
        make_plan(model, devices, tensor_split=[1, 1, 1])
    with pytest.raises(PlanError, match="coordinator's CPU"):
        make_plan(model, devices, n_gpu_layers=2)
    with pytest.raises(PlanError, match="unknown --weights"):
        make_plan(model, devices, weights="tiny")
    cpu = PlanDevice("local:cpu", "cpu", 1 << 40)
    offloaded = make_plan(model, devices, cpu=cpu, n_gpu_layers=2, ctx=64)
    assert [s.device.worker for s in offloaded.stages] == ["local:cpu", "a:1", "b:1"]


def test_auto_takes_the_first_mode_that_fits_each_device():
    model = open_model(model_path("llama", "Q6_K"))

    def weights(free, kernels=True):
        return make_plan(
            model, [PlanDevice("w:1", "cpu", free, kernels=kernels)], ctx=64, prefill_chunk=16, weights="auto"
        ).stages[0]

    roomy = weights(1 << 40)
    assert roomy.weights == "fast"
    compact = make_plan(
        model, [PlanDevice("w:1", "cpu", 1 << 40, kernels=True)], ctx=64, prefill_chunk=16, weights="compact"
    ).stages[0]
    assert weights(compact.total_bytes).weights == "compact"
    assert weights(1 << 40, kernels=False).weights == "dequant"


def test_blocks_of_different_sizes_split_by_their_bytes():
    """A mixture of experts with dense leading blocks: devices get bytes, not block counts, in
    proportion to their memory; blocks of one size still split by count."""
    assert split_blocks_by_bytes([10] * 4, [1.0, 1.0]) == split_blocks_evenly(4, [1.0, 1.0]) == [2, 2]
    assert split_blocks_by_bytes([1, 1, 1, 10, 10, 10], [1.0, 1.0]) == [4, 2]
    assert split_blocks_by_bytes([1, 1, 1, 10, 10, 10], [3.0, 1.0]) == [5, 1]
    assert split_blocks_by_bytes([2, 10, 10, 10, 10], [1.0, 1.0]) == [3, 2]
