"""A loaded plan's objects are kept out of the cycle collector's passes while it serves
(devices.objects_held_for_good: the full passes a decode loop's allocations set off took 4% of a
DeepSeek-V3 layout's decode step walking them) and given back to it when the plan is released."""

from __future__ import annotations

import gc

from shardwire.coordinator.launch import local_pipeline
from shardwire.formats import open_model

from models import model_path


def _collected(obj) -> bool:
    """Whether the collector's generations hold `obj` (frozen objects are in none of them)."""
    return any(o is obj for o in gc.get_objects())


def test_a_local_pipelines_objects_are_frozen_while_it_serves_and_let_go_when_closed():
    pipeline = local_pipeline(open_model(model_path("llama")), "cpu", "float32", "dequant", 1, 64)
    stage = pipeline.stages[0]
    try:
        assert gc.get_freeze_count() > 0
        assert not _collected(stage) and not _collected(stage.blocks[0])
    finally:
        pipeline.close()
    assert gc.get_freeze_count() == 0
    assert _collected(stage)
