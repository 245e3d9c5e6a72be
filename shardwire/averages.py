"""Moving averages of what steps cost: each new figure moves the average a fifth of the way towards
it, so that a change in the machine's speed shows within a few steps and one slow step does not."""

from __future__ import annotations

WEIGHT = 0.2


def moved(average: float | None, value: float, weight: float = WEIGHT) -> float:
    """`average` moved towards `value`; the first figure is taken whole."""
    return value if average is None else average + weight * (value - average)
