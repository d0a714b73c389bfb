"""Model definitions, one file per architecture family, looked up by the config's family."""
from __future__ import annotations

from tallow.loader.config import ModelConfig

# family -> (module, class). Families of the model zoo arrive with their own files.
_REGISTRY = {
    "llama": ("tallow.models.llama", "LlamaForCausalLM"),
    "mistral": ("tallow.models.llama", "LlamaForCausalLM"),
    "qwen2": ("tallow.models.llama", "LlamaForCausalLM"),
}


class UnsupportedModelError(ValueError):
    pass


def supported_families() -> list[str]:
    return sorted(_REGISTRY)


def build_model(cfg: ModelConfig, weights: dict, dtype, max_positions: int | None = None):
    entry = _REGISTRY.get(cfg.family)
    if entry is None:
        raise UnsupportedModelError(
            f"model family {cfg.family!r} ({cfg.architecture}) is not supported by the engine yet; "
            f"supported: {', '.join(supported_families())}")
    import importlib

    cls = getattr(importlib.import_module(entry[0]), entry[1])
    return cls(cfg, weights, dtype, max_positions)
