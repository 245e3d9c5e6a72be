"""Names of the tensors shardwire holds one per expert."""

EXPERT_MATRICES = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


def expert_name(block: int, matrix: str, expert: int) -> str:
    """The name of one expert's matrix: GGUF stores all of a block's experts as one 3-D tensor
    (`blk.N.ffn_gate_exps.weight`), shardwire holds them one matrix per expert."""
    return f"blk.{block}.{matrix}.{expert}.weight"
