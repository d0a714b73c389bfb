"""The one registry of model families, built from the family files themselves.

Every module in tallow/models (except this one and __init__) is imported once, on first use; each class
in it that sets `family` in its own body (a tallow.config.FamilyConfig, usually via DecoderForCausalLM)
is a family. A new family is a new file: nothing here or in tallow/config.py, loader/ or server/ names it.

Everything family-specific that other modules need is read from here: the Hugging Face architecture
names and model_types (tallow.config), the per-model_type defaults (tallow.config, tests), the GGUF
architectures and tensor-name maps (loader/gguf_weights.py), the tool-parser hint
(server/tool_parsers.py)."""
from __future__ import annotations

import importlib
import pkgutil
import threading
from typing import Optional

_LOCK = threading.RLock()
_FAMILIES: Optional[dict[str, type]] = None  # family -> model class
_EXTRA: dict[str, type] = {}  # register() calls (tests, plug-ins)
_REMOVED: set[str] = set()


def _discover() -> dict[str, type]:
    global _FAMILIES
    if _FAMILIES is not None:
        return _FAMILIES
    with _LOCK:
        if _FAMILIES is None:
            import tallow.models as pkg

            found: dict[str, type] = {}
            for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
                if info.name in ("registry",) or info.name.startswith("_"):
                    continue
                mod = importlib.import_module(f"tallow.models.{info.name}")
                for obj in vars(mod).values():
                    if isinstance(obj, type) and obj.__module__ == mod.__name__ and "family" in vars(obj) \
                            and obj.family:
                        if obj.family in found and found[obj.family] is not obj:
                            raise RuntimeError(f"model family {obj.family!r} is defined twice: "
                                               f"{found[obj.family].__module__} and {mod.__name__}")
                        found[obj.family] = obj
            _FAMILIES = found
    return _FAMILIES


def _all() -> dict[str, type]:
    out = {k: v for k, v in _discover().items() if k not in _REMOVED}
    out.update(_EXTRA)
    return out


def register(cls: type) -> None:
    """Add (or replace) a family served by `cls` (a model class with `family` set)."""
    _EXTRA[cls.family] = cls
    _REMOVED.discard(cls.family)


def unregister(family: str) -> None:
    _EXTRA.pop(family, None)
    _REMOVED.add(family)


def families() -> list[str]:
    return sorted(_all())


def model_class(family: str) -> Optional[type]:
    return _all().get(family)


def family_for_hf(architecture: Optional[str], *model_types: Optional[str]) -> Optional[type]:
    """The family class for a config.json's architectures[0], else its (text) model_type."""
    fams = _all().values()
    for cls in fams:
        if architecture and architecture in cls.hf_architectures:
            return cls
    for mt in model_types:
        if isinstance(mt, str):
            for cls in fams:
                if mt.lower() in cls.model_types:
                    return cls
    return None


def family_for_gguf(arch: str) -> Optional[type]:
    for cls in _all().values():
        if arch in cls.gguf_architectures:
            return cls
    return None


def gguf_architectures() -> list[str]:
    return [a for f in families() for a in model_class(f).gguf_architectures]


def config_defaults() -> dict[str, dict]:
    """model_type -> transformers' defaults, over every family."""
    out: dict[str, dict] = {}
    for f in families():
        out.update(model_class(f).config_defaults)
    return out


def tool_parser_hint(family: Optional[str]) -> Optional[str]:
    cls = model_class((family or "").lower())
    return None if cls is None else cls.tool_parser
