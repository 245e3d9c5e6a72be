"""The families shardwire runs, by architecture: adding one is a module and a line here."""

from __future__ import annotations

from ..config import ConfigError, ModelConfig
from . import deepseek2, gemma3, glm4moe, gpt_oss, llama, qwen35
from .family import BlockVariant, Family

FAMILIES: tuple[Family, ...] = tuple(
    Family.of(module) for module in (llama, qwen35, gemma3, glm4moe, deepseek2, gpt_oss)
)
_BY_ARCH = {arch: family for family in FAMILIES for arch in family.archs}
_BY_HF_TYPE = {model_type: family for family in FAMILIES for model_type in family.hf_types}
ARCHS = tuple(_BY_ARCH)
HF_TYPES = tuple(sorted(_BY_HF_TYPE))


def family_of(arch: str, where: str = "model config") -> Family:
    if arch not in _BY_ARCH:
        raise ConfigError(f"{where}: unsupported architecture '{arch}' (supported: {', '.join(ARCHS)})")
    return _BY_ARCH[arch]


def hf_family(model_type: str, where: str) -> Family:
    if model_type not in _BY_HF_TYPE:
        raise ConfigError(f"{where}: unsupported architecture '{model_type}' (supported: {', '.join(HF_TYPES)})")
    return _BY_HF_TYPE[model_type]


def checked(cfg: ModelConfig) -> ModelConfig:
    """`cfg`, once its family has checked the fields that are its own."""
    family_of(cfg.arch).check(cfg)
    return cfg


def config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig sent as ModelConfig.to_dict gives it, checked by its family."""
    return checked(ModelConfig.from_dict(d))


def variant(cfg: ModelConfig, block: int) -> BlockVariant:
    return family_of(cfg.arch).variant(cfg, block)
