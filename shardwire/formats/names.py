"""Names of the tensors shardwire holds one per expert."""

import re

EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
GROUPED_EXPERTS = "ffn_exps"  # a block's key for a module holding all its experts at once
_EXPERT = re.compile(r"^blk\.(\d+)\.(ffn_(?:gate|up|down)_exps)\.(\d+)\.weight$")


def expert_name(block: int, matrix: str, expert: int) -> str:
    """The name of one expert's matrix: GGUF stores all of a block's experts as one 3-D tensor
    (`blk.N.ffn_gate_exps.weight`), shardwire holds them one matrix per expert."""
    return f"blk.{block}.{matrix}.{expert}.weight"


def expert_of(name: str) -> tuple[int, str, int] | None:
    """(block, matrix, expert) of an expert's matrix name, else None."""
    m = _EXPERT.match(name)
    return (int(m[1]), m[2], int(m[3])) if m else None
