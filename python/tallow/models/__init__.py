"""Model definitions, one file per family, and the one entry point the engine uses: `load_model`.

Each tallow/models/<family>.py holds everything its family needs (the Hugging Face architecture names and
model_types it serves, its config defaults and normalisation, its GGUF architecture and tensor names, its
tool-parser hint, its module tree); models/registry.py builds the registry from those files. Adding a
family is adding a file (plus its test and the docs table).

A model is built EMPTY from its config on the target device (parameters allocated there, each through its
layer's quantization method), then weights stream in through per-parameter loaders: from safetensors
(mmap -> device, one tensor at a time), GGUF (block types kept), or random values in place (dummy)."""
from __future__ import annotations

import math

from tallow.config import ModelConfig
from tallow.models import registry


class UnsupportedModelError(ValueError):
    pass


def register(cls: type) -> None:
    """Add (or replace) a family: `cls` is a model class with `family` and its names set."""
    registry.register(cls)


def supported_families() -> list[str]:
    return registry.families()


def model_class(family: str):
    cls = registry.model_class(family)
    if cls is None:
        raise UnsupportedModelError(f"model family {family!r} is not supported by the engine yet; "
                                    f"supported: {', '.join(supported_families())}")
    return cls


def _check_family(cfg: ModelConfig):
    if registry.model_class(cfg.family) is None:
        raise UnsupportedModelError(
            f"model family {cfg.family!r} ({cfg.architecture}) is not supported by the engine yet; "
            f"supported: {', '.join(supported_families())}")
    return registry.model_class(cfg.family)


def build_model(cfg: ModelConfig, weights: dict, dtype, max_positions: int | None = None, device: str = "cpu",
                quant_config=None):
    """The model of `cfg` built empty and loaded from `weights` ({Hugging Face name: Tensor}; tests and tools)."""
    import tallow

    cls = _check_family(cfg)
    model = cls(cfg, dtype or tallow.float32, max_positions, device=device, quant_config=quant_config)
    model.load_weights(weights.items())
    return model


def load_model(cfg: ModelConfig, source, dtype, device: str = "cpu", *, load_format: str = "auto", seed: int = 0,
               max_positions: int | None = None, quant_config=None, isq: str | None = None, tp_rank: int = 0,
               tp_size: int = 1):
    """The model of `cfg` on `device` in `dtype`, its weights from `source` (a loader.source.ModelSource),
    or random ones when load_format == "dummy". The one entry point the engine's executor uses.

    quant_config: a layers.quantization config (default: the checkpoint's own, e.g. GGUF block types).
    isq: an --isq type (q4k, q8_0, ...): float weights are quantized to it on `device` while they load
    (layers/quantization/isq.py), with a progress bar.
    tp_rank / tp_size: this rank's shard of a tensor-parallel model (each layer loads its shard)."""
    cls = _check_family(cfg)
    if isq is not None:
        from tallow.layers.quantization import isq_config

        if getattr(source, "kind", None) == "gguf" and load_format != "dummy":
            raise ValueError(f"--isq {isq}: {source.path} is a GGUF file, already quantized; drop --isq, or "
                             "quantize the safetensors checkpoint (tallow quantize re-types GGUF files)")
        quant_config = isq_config(isq, cfg)
    if load_format == "dummy":
        from tallow.loader.dummy import fill_dummy

        model = cls(cfg, dtype, max_positions, device=device, quant_config=quant_config, tp_rank=tp_rank,
                    tp_size=tp_size)
        fill_dummy(model, seed=seed or 0)
        return model
    from tallow.layers.quantization import config_for_checkpoint
    from tallow.loader.source import iter_weights

    gguf = None
    if getattr(source, "kind", None) == "gguf":
        from tallow.loader.gguf_weights import GGUFWeights

        gguf = GGUFWeights(source.gguf, family=cls)
    if quant_config is None:
        quant_config = config_for_checkpoint(source, None if gguf is None else gguf.dtypes())
    model = cls(cfg, dtype, max_positions, device=device, quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
    if getattr(quant_config, "name", None) == "isq":
        from tallow.layers.quantization.isq import with_progress

        weights = with_progress(iter_weights(source, progress=False, gguf=gguf), source, quant_config)
    else:
        weights = iter_weights(source, gguf=gguf)
    model.load_weights(weights)
    return model


def dummy_weights(cfg: ModelConfig, dtype, device: str = "cpu", seed: int = 0) -> dict:
    """{seed name: parameter (or its rows)} of a dummy-loaded model of `cfg` (tests and tools)."""
    import tallow
    from tallow.layers.module import modules

    if isinstance(dtype, str):
        dtype = tallow._core.dtype(dtype)
    model = load_model(cfg, None, dtype, device, load_format="dummy", seed=seed)
    out = {}
    for m in modules(model):
        for view, name, _kind, _fan_in in m.dummy_parts():
            out[name] = view.view(view.shape[-1]) if ".norms." in name else view
    return out


def checkpoint_names(cfg: ModelConfig) -> dict[str, tuple]:
    """{checkpoint name: shape} of every tensor a model of `cfg` loads, under its unfused names
    (q/k/v, gate/up, per-expert, per-head): what a Hugging Face checkpoint of `cfg` holds. Builds the model
    empty on the host (the allocation is not touched)."""
    import tallow
    from tallow.layers.linear import LinearBase
    from tallow.layers.module import modules

    cls = model_class(cfg.family)
    model = cls(cfg, tallow.float32, 1)
    out = {}
    for m in modules(model):
        fused = isinstance(m, LinearBase) and m.fused_name is not None and \
            m.fused_name.rsplit(".", 1)[-1] in cls.checkpoint_fused
        for name, (param, shard) in m.checkpoint_map().items():
            t = getattr(m, param)
            if isinstance(m, LinearBase):
                if (shard is None and len(m.part_names) > 1) != fused:
                    continue  # the names this family's checkpoints do not use
                if fused:
                    out[name] = tuple(t.shape)
                    continue
                rows = m.output_sizes[shard or 0]
                out[name] = (rows, m.input_size) if param == "weight" else (rows,)
            elif shard is not None:
                out[name] = tuple(t.shape[1:])
            else:
                out[name] = tuple(t.shape)
    return out


def num_params(cfg: ModelConfig, include_embedding: bool = True) -> int:
    """Parameters of a checkpoint of `cfg` (benchmarks: the weights a decode step reads are those without
    the token embedding table, of which it reads one row per token)."""
    return sum(math.prod(shape) for name, shape in checkpoint_names(cfg).items()
               if include_embedding or name != "model.embed_tokens.weight")


def weight_bytes(model) -> dict[str, int]:
    """{dtype name: bytes} of the model's parameters, each tensor counted once (a tied lm head shares
    the token table), largest first."""
    from tallow.layers.module import modules

    seen, out = set(), {}
    for m in modules(model):
        for name in m.param_names:
            for t in [getattr(m, name, None)] + list(getattr(m, "weight_parts", None) or []):
                if t is None or t.nbytes == 0:
                    continue
                key = (str(t.device), t.data_ptr, t.nbytes)
                if key in seen:
                    continue
                seen.add(key)
                out[t.dtype.name] = out.get(t.dtype.name, 0) + t.nbytes
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def weight_memory_line(model, device: str) -> str:
    """One start-up log line: "weights: 4.58 GiB on cuda:0 (q4_k 3.52, q6_k 0.98, float32 0.0003)" (GiB)."""
    per = weight_bytes(model)
    gib = 2.0 ** 30

    def fmt(b: int) -> str:
        v = b / gib
        return f"{v:.2f}" if v >= 0.01 else f"{v:.2g}"

    return f"weights: {fmt(sum(per.values()))} GiB on {device} ({', '.join(f'{k} {fmt(v)}' for k, v in per.items())})"
