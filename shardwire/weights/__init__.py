"""Quantized weights: GGUF block codecs (codecs.py), PyTorch's packed kernels and their layouts
(kernels.py), packed linear modules and their converters (packed.py), and which format each
stored type gets under each --weights mode (policy.py)."""
