"""Everything from "a model name or path" to config + weights as tallow tensors."""
from tallow.config import ConfigError, ModelConfig, RopeConfig
from tallow.loader.gguf_reader import GGUFError, GGUFFile
from tallow.loader.gguf_weights import load_gguf_weights
from tallow.loader.hub import download_model
from tallow.loader.safetensors_loader import SafetensorsCheckpoint, load_safetensors
from tallow.loader.source import ModelSource, load_weights, resolve_model_source

__all__ = [
    "ConfigError", "ModelConfig", "RopeConfig",
    "GGUFError", "GGUFFile", "load_gguf_weights", "download_model", "SafetensorsCheckpoint", "load_safetensors",
    "ModelSource", "load_weights", "resolve_model_source",
]
