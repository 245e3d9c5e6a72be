"""Model files shardwire makes for itself, outside the runtime package: a GGUF and Hugging Face
writer (writer.py), random test models on real vocabularies (synthetic.py), and the demo's
trained glassllm model converted to both formats (glassllm.py, needs the `demo` extra)."""
