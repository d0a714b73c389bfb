"""Model definitions, one file per architecture family, looked up by the config's family.

ModelConfig maps a Hugging Face `architectures[0]` / `model_type` or a GGUF `general.architecture` to a
family (loader/config.py); this registry maps the family to its class. A family whose file is not
written yet is simply absent here: `build_model` then lists the supported ones."""
from __future__ import annotations

import importlib

from tallow.loader.config import ModelConfig

# family -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "llama": ("tallow.models.llama", "LlamaForCausalLM"),
    "mistral": ("tallow.models.mistral", "MistralForCausalLM"),
    "qwen2": ("tallow.models.qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("tallow.models.qwen3", "Qwen3ForCausalLM"),
    "qwen2_moe": ("tallow.models.qwen2_moe", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("tallow.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "phi3": ("tallow.models.phi3", "Phi3ForCausalLM"),
    "gemma2": ("tallow.models.gemma2", "Gemma2ForCausalLM"),
    "gemma3": ("tallow.models.gemma3", "Gemma3ForCausalLM"),
    "stablelm": ("tallow.models.stablelm", "StableLmForCausalLM"),
    "glm4": ("tallow.models.glm4", "Glm4ForCausalLM"),
}


class UnsupportedModelError(ValueError):
    pass


def register(family: str, module: str, cls: str) -> None:
    """Add (or replace) the class for `family`."""
    _REGISTRY[family] = (module, cls)


def supported_families() -> list[str]:
    return sorted(_REGISTRY)


def model_class(family: str):
    entry = _REGISTRY.get(family)
    if entry is None:
        raise UnsupportedModelError(f"model family {family!r} is not supported by the engine yet; "
                                    f"supported: {', '.join(supported_families())}")
    return getattr(importlib.import_module(entry[0]), entry[1])


def build_model(cfg: ModelConfig, weights: dict, dtype, max_positions: int | None = None):
    if cfg.family not in _REGISTRY:
        raise UnsupportedModelError(
            f"model family {cfg.family!r} ({cfg.architecture}) is not supported by the engine yet; "
            f"supported: {', '.join(supported_families())}")
    return model_class(cfg.family)(cfg, weights, dtype, max_positions)


def load_model(cfg: ModelConfig, source, dtype, device: str = "cpu", *, load_format: str = "auto", seed: int = 0,
               max_positions: int | None = None):
    """The model of `cfg` on `device` in `dtype`, its weights from `source` (a loader.source.ModelSource),
    or random ones when load_format == "dummy". The one entry point the engine's executor uses."""
    import tallow

    if load_format == "dummy":
        from tallow.loader.dummy import dummy_weights

        weights = dummy_weights(cfg, dtype, device, seed=seed or 0, fused=True)
    else:
        from tallow.loader.source import load_weights

        weights = load_weights(source)
        if device != "cpu":  # straight from the mmap to the device; fusing/casting happen there
            weights = {name: t.to(device) if isinstance(t, tallow.Tensor) else t for name, t in weights.items()}
    model = build_model(cfg, weights, dtype, max_positions=max_positions)
    del weights
    if device != "cpu":
        from tallow.layers.weights import move_to_device

        move_to_device(model, device)
    return model
