"""How a weight lives on its device: GGUF block codecs (codecs.py), PyTorch's packed kernels and
their layouts (kernels.py) and modules (packed.py), ggml's (ggml_cpu.py), the module of a format
(pack.py), what this machine measured (measure.py, load.py), which format each stored type gets
under each --weights mode and each device's compute dtype (policy.py), the kernels line
(in_use.py), and the content-addressed weights cache (cache.py)."""
