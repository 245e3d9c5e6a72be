"""The model families: one module each (llama.py, qwen35.py, gemma3.py), what they declare (family.py), the
registry that finds them by architecture (registry.py) and the config readers (configs.py)."""

from .configs import from_gguf_metadata, from_hf_config
from .family import BlockVariant, Family, block_of, require
from .registry import ARCHS, FAMILIES, checked, config_from_dict, family_of, hf_family, variant

__all__ = [
    "ARCHS",
    "FAMILIES",
    "BlockVariant",
    "Family",
    "block_of",
    "checked",
    "config_from_dict",
    "family_of",
    "from_gguf_metadata",
    "from_hf_config",
    "hf_family",
    "require",
    "variant",
]
