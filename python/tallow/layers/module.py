"""What every layer that owns parameters shares: the checkpoint names it loads, a per-parameter weight
loader, the record of what was loaded (for the missing-weight message) and the dummy-fill description.

A model is a tree of plain objects; `modules(model)` finds every Module in it (attributes, lists, tuples),
so a model file declares layers and nothing registers them by hand."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import tallow


class Module:
    """A layer owning parameters (attributes named in `param_names`).

    checkpoint_map() -> {checkpoint tensor name: (parameter, shard id)}: the names this layer loads.
    weight_loader(param, tensor, shard_id): copy one checkpoint tensor (or this rank's shard of it) in.
    missing() -> the checkpoint names of parameters (or parts) never loaded.
    dummy_parts() -> (view, seed name, kind, fan_in) to fill with random values (loader/dummy.py)."""

    prefix: str = ""
    param_names: tuple = ()

    def __init__(self, prefix: str = ""):
        self.prefix = prefix
        self._loaded: set = set()

    def checkpoint_map(self) -> dict:
        return {f"{self.prefix}.{p}": (p, None) for p in self.param_names if getattr(self, p, None) is not None}

    def weight_loader(self, param: str, loaded: tallow.Tensor, shard_id=None) -> None:
        from tallow.layers.quantization.base import copy_into

        copy_into(getattr(self, param), loaded)
        self._loaded.add((param, shard_id))

    def missing(self) -> list[str]:
        return [name for name, (p, s) in self.checkpoint_map().items()
                if (p, s) not in self._loaded and (p, None) not in self._loaded]

    def dummy_parts(self) -> Iterator[tuple]:
        return iter(())

    def process_weights_after_loading(self) -> None:
        pass


def modules(obj, _seen: Optional[set] = None) -> Iterator[Module]:
    """Every Module reachable from `obj` through attributes, lists, tuples and dicts, each once, in
    declaration order."""
    if _seen is None:
        _seen = set()
    if id(obj) in _seen:
        return
    if isinstance(obj, (list, tuple)):
        _seen.add(id(obj))
        for v in obj:
            yield from modules(v, _seen)
        return
    if isinstance(obj, dict):
        _seen.add(id(obj))
        for v in obj.values():
            yield from modules(v, _seen)
        return
    if isinstance(obj, tallow.Tensor) or not hasattr(obj, "__dict__") or dataclasses.is_dataclass(obj) \
            or not type(obj).__module__.startswith("tallow."):
        return
    _seen.add(id(obj))
    if isinstance(obj, Module):
        yield obj
    for v in vars(obj).values():
        yield from modules(v, _seen)
