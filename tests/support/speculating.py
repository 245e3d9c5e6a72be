"""Step costs for tests of speculative decoding that must not depend on this machine's timings."""

from shardwire.engine.drafting import StepCosts


class FreeWidth(StepCosts):
    """Steps of every width cost the same: the length follows the acceptance rate alone, whatever
    this machine measures (tests/engine/test_speculative.py pins how measured costs set it)."""

    def add(self, width: int, seconds: float) -> None:
        pass

    def of(self, width: int) -> float:
        return 1.0

    def measured(self, width: int) -> bool:
        return True
