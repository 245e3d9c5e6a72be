"""The names the command line, the plan, both sides of the wire and the loaders agree on,
declared once."""

from __future__ import annotations

COMPUTE_DTYPES = ("float32", "float16", "bfloat16")
# Bytes per element of a FORWARD payload: int32 token ids, or hidden states in a compute dtype.
PAYLOAD_DTYPES = {"int32": 4, "float32": 4, "float16": 2, "bfloat16": 2}

# How quantized weights live on a device (weights/policy.py): what a user may ask for, and what a
# stage is built with once the plan has resolved "auto" to one of the others.
WEIGHT_MODES = ("auto", "fast", "dequant", "packed", "compact")
STAGE_WEIGHT_MODES = ("fast", "dequant", "packed", "compact")

# How a weight matrix lives on its device (weights/): dense in the compute dtype, PyTorch's packed
# kernels' layouts, the stored blocks dequantized before use, the stored blocks under ggml's kernels,
# or those blocks in ggml's repacked layout for the CPU.
WEIGHT_FORMATS = ("dense", "int4", "int8x2", "int8", "gguf", "ggml", "repacked")

# Whose product multiplies a prompt chunk (or one row) where shardwire's ggml has one of its own for
# a stored type (weights/measure.py own_products): shardwire's, or ggml's own kernel.
PRODUCT_SOURCES = ("shardwire", "ggml")

# Tensor types as GGUF stores them.
PLAIN_TYPES = ("F32", "F16", "BF16", "F64")
# Blocks of small integers with a scale (and offset) per group: weights/codecs.py decodes them in torch
GROUPED_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
# Blocks whose values come from a fixed table (a lattice or a 4-bit float): held as stored and
# multiplied by ggml's kernels, or dequantized to the compute dtype where those do not run
CODEBOOK_TYPES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_NL", "IQ4_XS", "MXFP4")
QUANT_TYPES = GROUPED_TYPES + CODEBOOK_TYPES
STORED_TYPES = PLAIN_TYPES + QUANT_TYPES

PAGE = 16  # positions per KV page: what a sequence's cache grows by and prefix reuse shares


def pages_for(n_positions: int) -> int:
    return -(-n_positions // PAGE)
