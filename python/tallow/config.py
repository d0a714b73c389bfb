"""ModelConfig: everything a decoder-only model file needs, parsed from a Hugging Face config.json
(flat, nested `text_config`, legacy `rope_scaling`/`rope_theta` or transformers >= 5
`rope_parameters`) or from GGUF metadata.

What is common to every family lives here; what one family needs (the architecture names and
model_types it serves, its defaults, its biases / norms / layer pattern, its GGUF architecture) lives in
its own file, tallow/models/<family>.py, and reaches this module through the registry
(tallow.models.registry), which is imported lazily (the model files import this module).

Conventions (they match transformers' config classes, whose defaults fill keys a config.json leaves
out):
- `layer_types[i]` is "full_attention" or "sliding_attention"; a sliding layer attends to the last
  `sliding_window` keys. `rope_for_layer(i)` is the RoPE of that layer (gemma3's sliding layers use
  `rope_local`, the rest `rope`).
- `rotary_dim` = int(head_dim * partial_rotary_factor); `rope_neox` is the pairing of the Hugging
  Face weight layout (True: pairs (i, i + rotary_dim/2), rotate_half; False: interleaved pairs
  (2i, 2i+1), glm4). For GGUF files it is the same value: it assumes the weight loader undoes the q/k
  row permutation llama.cpp applies to llama-style architectures.
- `attention_scale` is the softmax scale (query_pre_attn_scalar ** -0.5 for gemma, else head_dim ** -0.5).
- MoE: `num_experts` == 0 means dense; `is_moe_layer(i)` follows Qwen-MoE's decoder_sparse_step /
  mlp_only_layers rule.

No torch import: this module is runtime code.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable

__all__ = [
    "ModelConfig", "RopeConfig", "ConfigError", "ConfigFileNotFoundError", "SUPPORTED_FAMILIES",
    "SUPPORTED_GGUF_ARCHITECTURES", "ROPE_TYPES",
    "FULL_ATTENTION", "SLIDING_ATTENTION",
]

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# Defaults of transformers' config classes every family shares, for keys a config.json may leave out;
# each family file adds its own per model_type (checked against transformers in tests/python/test_config.py).
COMMON_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "tie_word_embeddings": False, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "attention_bias": False, "mlp_bias": False, "sliding_window": None, "head_dim": None,
}
_COMMON_DEFAULTS = COMMON_DEFAULTS
# keys every config must name itself (families whose configs are customarily sparse are exempt:
# their defaults fill them)
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# top-level keys a nested text_config inherits when it lacks them
_INHERITED = ("tie_word_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id", "pad_token_id")


def _registry():
    from tallow.models import registry

    return registry


def __getattr__(name: str):
    """The registry-derived tables, computed on first use (the family files import this module)."""
    if name == "SUPPORTED_FAMILIES":
        return tuple(_registry().families())
    if name == "SUPPORTED_GGUF_ARCHITECTURES":
        return tuple(_registry().gguf_architectures())
    if name in ("_DEFAULTS", "DEFAULTS"):
        return _registry().config_defaults()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _supported_list() -> str:
    return ", ".join(_registry().families()) + " (and yi as llama)"


class ConfigError(ValueError):
    """A model configuration that cannot be used; the message names the file and the problem."""


class ConfigFileNotFoundError(ConfigError, FileNotFoundError):
    """The config file does not exist."""


# ------------------------------------------------------------------------------------------------
# RoPE
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """One rotary embedding's parameters, with transformers' names (see
    transformers.modeling_rope_utils.RopeParameters). `layers/rotary.py` turns it into inv_freq and the
    cos/sin cache.

    type: default | linear | dynamic | llama3 | yarn | longrope.
    max_position_embeddings: the model's (post-scaling) context; dynamic NTK and the implicit yarn /
      longrope factor use it.
    freq_factors: llama.cpp's per-frequency divisors (GGUF `rope_freqs` tensor, written for llama3-style
      models): when set, inv_freq = theta^(-2i/d) / freq_factors[i] and the llama3 formula is skipped.
    llama_4_scaling_beta: Ministral 3's position-dependent query scaling
      (q *= 1 + beta * log(1 + floor(pos / original_max_position_embeddings))); not part of cos/sin.
    """

    type: str = "default"
    theta: float = 10000.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    max_position_embeddings: int | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # yarn (beta_fast/beta_slow None -> 32/1)
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn / longrope: explicit cos/sin scaling (None -> derived from factor)
    attention_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None
    # GGUF
    freq_factors: tuple[float, ...] | None = None
    llama_4_scaling_beta: float | None = None

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {self.type!r}; supported: {', '.join(ROPE_TYPES)}")
        if not (self.theta > 0):
            raise ValueError(f"RoPE theta must be positive, got {self.theta}")
        needs_factor = self.type in ("linear", "dynamic") or (self.type == "llama3" and self.freq_factors is None)
        if needs_factor and self.factor is None:
            raise ValueError(f"RoPE type {self.type!r} needs a 'factor'")
        if self.type == "llama3" and self.freq_factors is None:
            missing = [k for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
                       if getattr(self, k) is None]
            if missing:
                raise ValueError(f"RoPE type 'llama3' needs {', '.join(missing)}")
        if self.type == "dynamic" and self.max_position_embeddings is None:
            raise ValueError("RoPE type 'dynamic' needs max_position_embeddings")
        if self.type in ("yarn", "longrope"):
            if self.original_max_position_embeddings is None:
                raise ValueError(f"RoPE type {self.type!r} needs original_max_position_embeddings")
            if self.factor is None and self.max_position_embeddings is None:
                raise ValueError(f"RoPE type {self.type!r} needs a 'factor' or max_position_embeddings")
        if self.type == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError("RoPE type 'longrope' needs 'short_factor' and 'long_factor'")

    @property
    def scaled(self) -> bool:
        return self.type != "default" or self.freq_factors is not None

    @classmethod
    def from_hf(cls, params: dict | None, *, max_position_embeddings: int | None, theta: float | None = None,
                original_max_position_embeddings: int | None = None) -> "RopeConfig":
        """From a transformers rope dict (`rope_scaling` or one flat `rope_parameters`). `theta` is used
        when the dict has no rope_theta; a top-level `original_max_position_embeddings` (phi3) wins over
        the dict's, as in transformers' standardize_rope_params."""
        p = dict(params or {})
        rtype = p.get("rope_type", p.get("type")) or "default"
        rtype = str(rtype).lower()
        if rtype == "su":  # Phi-3's old name for longrope
            rtype = "longrope"
        if rtype == "none":
            rtype = "default"
        if rtype not in ROPE_TYPES:
            raise ValueError(f"unsupported RoPE type {rtype!r}; supported: {', '.join(ROPE_TYPES)}")
        th = p.get("rope_theta", theta)
        th = 10000.0 if th is None else float(th)
        orig = None
        if rtype in ("llama3", "yarn", "longrope"):
            orig = original_max_position_embeddings or p.get("original_max_position_embeddings") \
                or max_position_embeddings
        elif p.get("original_max_position_embeddings") is not None:
            orig = p["original_max_position_embeddings"]

        def f(key):
            v = p.get(key)
            return None if v is None else float(v)

        def seq(key):
            v = p.get(key)
            return None if v is None else tuple(float(x) for x in v)

        return cls(
            type=rtype, theta=th, factor=f("factor"),
            original_max_position_embeddings=None if orig is None else int(orig),
            max_position_embeddings=None if max_position_embeddings is None else int(max_position_embeddings),
            low_freq_factor=f("low_freq_factor"), high_freq_factor=f("high_freq_factor"),
            beta_fast=f("beta_fast"), beta_slow=f("beta_slow"), mscale=f("mscale"),
            mscale_all_dim=f("mscale_all_dim"), truncate=bool(p.get("truncate", True)),
            attention_factor=f("attention_factor"), short_factor=seq("short_factor"),
            long_factor=seq("long_factor"), llama_4_scaling_beta=f("llama_4_scaling_beta"),
        )


# ------------------------------------------------------------------------------------------------
# What a family declares (tallow/models/<family>.py: its model class derives from this)
# ------------------------------------------------------------------------------------------------
class FamilyConfig:
    """The config side of a model family: which names it serves and how its config is normalised.
    A model class in tallow/models/<family>.py that sets `family` in its own body is registered
    (tallow.models.registry); subclasses inherit the hooks and override what differs.

    The builders below compute every field the common way first (as a family with no quirks would);
    `hf_config` / `gguf_config` then adjust the family's own fields in place."""

    family: str = ""  # the registry key (also ModelConfig.family)
    hf_architectures: tuple[str, ...] = ()  # config.json architectures[0]; the first names GGUF models
    model_types: tuple[str, ...] = ()  # config.json model_type (text_config's for multimodal checkpoints)
    gguf_architectures: tuple[str, ...] = ()  # GGUF general.architecture values served
    config_defaults: dict[str, dict[str, Any]] = {}  # model_type -> transformers' defaults
    # GGUF tensor names: blk.N.<key> -> model.layers.N.<value> (no .weight/.bias), per GGUF architecture
    gguf_tensor_names: dict[str, dict[str, str]] = {}
    gguf_permuted_qk = False  # convert_hf_to_gguf permutes q/k rows (LlamaModel.permute): undo
    gguf_norm_shifted = False  # convert_hf_to_gguf stores norm weights as 1 + w: undo
    gguf_hidden_act = "silu"
    checkpoint_fused: tuple[str, ...] = ()  # fused layers its checkpoints store as one tensor (Phi-3: qkv_proj)
    gguf_written_as: str | None = None  # llama.cpp converts this family's checkpoints as another architecture
    tool_parser: str | None = None  # server/tool_parsers.py's parser when the chat template does not tell
    norm_type = "rms_norm"  # or "layer_norm"
    rope_neox = True
    sliding_window_opt_in = False  # a sliding window applies only with use_sliding_window (Qwen)
    legacy_rope_local = False  # legacy rope_scaling: global layers only; rope_local_base_freq for sliding ones

    @classmethod
    def hf_layer_types(cls, get, n_layers: int, sliding_window) -> list[str] | None:
        """layer_types when config.json has none (None: every layer sliding when there is a window)."""
        return None

    @classmethod
    def hf_config(cls, get, fields: dict) -> None:
        """Adjust the fields of a Hugging Face config's ModelConfig (biases, q/k norms, MoE, ...)."""

    @classmethod
    def gguf_config(cls, key, md: dict, has, fields: dict) -> None:
        """Adjust the fields of a GGUF file's ModelConfig. key(k, default, required) reads
        "<arch>.k"; has(t) says whether blk.0.t exists."""


# ------------------------------------------------------------------------------------------------
# ModelConfig
# ------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class ModelConfig:
    architecture: str  # Hugging Face class name, e.g. "LlamaForCausalLM" (for GGUF: the family's class)
    family: str  # one of SUPPORTED_FAMILIES (a models/<family>.py)
    model_type: str  # the (text) config's model_type, or the GGUF architecture
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rope: RopeConfig  # full-attention layers (all layers unless rope_local is set)
    rope_local: RopeConfig | None = None  # sliding layers, where it differs (gemma3: rope_local_base_freq)
    partial_rotary_factor: float = 1.0
    rotary_dim: int = 0  # int(head_dim * partial_rotary_factor); filled in when 0
    rope_neox: bool = True
    norm_type: str = "rms_norm"  # or "layer_norm" (stablelm)
    norm_eps: float = 1e-6
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # per-head RMSNorm (qwen3, gemma3) / LayerNorm (stablelm qk_layernorm) on q and k
    use_parallel_residual: bool = False  # stablelm
    sliding_window: int | None = None
    layer_types: list[str] = dataclasses.field(default_factory=list)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    query_pre_attn_scalar: float | None = None
    # MoE (num_experts == 0: dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = dataclasses.field(default_factory=list)
    # tokens
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    dtype: str | None = None  # torch_dtype / dtype of the checkpoint ("bfloat16", ...)
    source: str = "hf"  # "hf" or "gguf"
    raw: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # the (text) config dict

    def __post_init__(self):
        if self.family not in _registry().families():
            raise ValueError(f"unknown model family {self.family!r}; supported: {_supported_list()}")
        if not self.rotary_dim:
            self.rotary_dim = int(self.head_dim * self.partial_rotary_factor)
        if self.rotary_dim % 2 or not (0 < self.rotary_dim <= self.head_dim):
            raise ValueError(f"rotary dimension {self.rotary_dim} must be even and in (0, head_dim={self.head_dim}]")
        if not self.layer_types:
            self.layer_types = [FULL_ATTENTION] * self.num_hidden_layers
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads}")
        if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
            raise ValueError("layer_types has sliding layers but sliding_window is not set")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def rms_norm_eps(self) -> float | None:
        return self.norm_eps if self.norm_type == "rms_norm" else None

    @property
    def layer_norm_eps(self) -> float | None:
        return self.norm_eps if self.norm_type == "layer_norm" else None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def attention_scale(self) -> float:
        """Softmax scale applied to q.k."""
        return (self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim) ** -0.5

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_sliding_layer(self, i: int) -> bool:
        return self.layer_types[i] == SLIDING_ATTENTION

    def sliding_window_for_layer(self, i: int) -> int | None:
        return self.sliding_window if self.is_sliding_layer(i) else None

    def rope_for_layer(self, i: int) -> RopeConfig:
        if self.rope_local is not None and self.is_sliding_layer(i):
            return self.rope_local
        return self.rope

    def is_moe_layer(self, i: int) -> bool:
        """Qwen-MoE's rule: sparse unless in mlp_only_layers, every decoder_sparse_step-th layer."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % max(self.decoder_sparse_step, 1) == 0)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("raw")
        return d

    # -- overrides -------------------------------------------------------------------------------
    def with_yarn_scaling(self, factor: float, original_max_position_embeddings: int | None = None) -> "ModelConfig":
        """The `--yarn-scaling-factor` override: a copy whose (full-attention) RoPE is yarn with `factor`,
        original_max_position_embeddings = the current max_position_embeddings (or the given value), and
        max_position_embeddings = original * factor. yarn's other parameters (theta, betas) are kept when the
        model already uses yarn (and then its original context stays the original). Sliding layers'
        separate RoPE (gemma3) is left alone: a window never exceeds the trained context."""
        factor = float(factor)
        if not (factor > 1.0) or not math.isfinite(factor):
            raise ValueError(f"yarn scaling factor must be a finite number > 1, got {factor}")
        old = self.rope
        if original_max_position_embeddings is None:
            if old.type == "yarn" and old.original_max_position_embeddings:
                original_max_position_embeddings = old.original_max_position_embeddings
            else:
                original_max_position_embeddings = self.max_position_embeddings
        orig = int(original_max_position_embeddings)
        new_max = int(orig * factor)
        keep = old.type == "yarn"
        rope = RopeConfig(
            type="yarn", theta=old.theta, factor=factor, original_max_position_embeddings=orig,
            max_position_embeddings=new_max,
            beta_fast=old.beta_fast if keep else None, beta_slow=old.beta_slow if keep else None,
            mscale=old.mscale if keep else None, mscale_all_dim=old.mscale_all_dim if keep else None,
            truncate=old.truncate if keep else True, llama_4_scaling_beta=old.llama_4_scaling_beta,
        )
        return dataclasses.replace(self, rope=rope, max_position_embeddings=new_max, layer_types=list(self.layer_types),
                                   mlp_only_layers=list(self.mlp_only_layers), raw=self.raw)

    # -- Hugging Face ----------------------------------------------------------------------------
    @classmethod
    def from_pretrained_dir(cls, path: str | os.PathLike) -> "ModelConfig":
        """Read `path`/config.json (or `path` itself when it is a file)."""
        path = os.fspath(path)
        file = path if os.path.isfile(path) else os.path.join(path, "config.json")
        try:
            with open(file, "rb") as f:
                text = f.read()
        except FileNotFoundError:
            raise ConfigFileNotFoundError(f"{file}: no such file (a model directory needs a config.json)") from None
        except IsADirectoryError:
            raise ConfigError(f"{file}: is a directory, not a config.json") from None
        except OSError as e:
            raise ConfigError(f"{file}: cannot read ({e.strerror or e})") from None
        try:
            d = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{file}: not valid JSON ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{file}: expected a JSON object, got {type(d).__name__}")
        return cls.from_hf_dict(d, source=file)

    @classmethod
    def from_hf_dict(cls, d: dict, *, source: str = "config") -> "ModelConfig":
        """From a config.json dict (or `PretrainedConfig.to_dict()`). `source` names it in errors."""
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a dict, got {type(d).__name__}")
        archs = d.get("architectures") or []
        architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
        text = d
        where = source
        if isinstance(d.get("text_config"), dict):
            text = dict(d["text_config"])
            for k in _INHERITED:
                if k not in text and k in d:
                    text[k] = d[k]
            where = f"{source} (text_config)"
        model_type = text.get("model_type") or d.get("model_type") or ""
        spec = _registry().family_for_hf(architecture, text.get("model_type"), d.get("model_type"))
        if spec is None:
            what = architecture or model_type or "<none>"
            raise ConfigError(f"{source}: unsupported architecture {what!r} (model_type {model_type!r}); "
                              f"supported families: {_supported_list()}")
        family = spec.family
        if not model_type:
            model_type = family
        fam_defaults = spec.config_defaults
        defaults = {**COMMON_DEFAULTS, **fam_defaults.get(model_type, fam_defaults.get(family, {}))}
        missing = [k for k in _REQUIRED if text.get(k) is None and k not in defaults]
        if missing:
            raise ConfigError(f"{where}: missing required key(s) {', '.join(repr(k) for k in missing)}")

        def get(key, *aliases, default=None):
            """The first non-null value among the keys; an explicit null (and no other spelling) stays
            None, as in transformers; an absent key takes the family default."""
            present = False
            for k in (key, *aliases):
                if k in text:
                    present = True
                    if text[k] is not None:
                        return text[k]
            if present:
                return None
            for k in (key, *aliases):
                if k in defaults:
                    return defaults[k]
            return default

        try:
            return _build_hf(cls, text, get, spec, model_type, architecture or spec.hf_architectures[0])
        except ConfigError:
            raise
        except (TypeError, KeyError) as e:
            raise ConfigError(f"{where}: malformed value ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ConfigError(f"{where}: {e}") from None

    # -- GGUF ------------------------------------------------------------------------------------
    @classmethod
    def from_gguf(cls, g) -> "ModelConfig":
        """From a tallow.loader.gguf_reader.GGUFFile's metadata (and its small rope factor tensors)."""
        path = getattr(g, "path", "GGUF")
        arch = g.metadata.get("general.architecture")
        spec = _registry().family_for_gguf(arch) if isinstance(arch, str) else None
        if spec is None:
            raise ConfigError(f"{path}: unsupported GGUF architecture {arch!r}; supported: "
                              f"{', '.join(_registry().gguf_architectures())}")
        try:
            return _build_gguf(cls, g, arch, spec, path)
        except ConfigError:
            raise
        except (TypeError, KeyError) as e:
            raise ConfigError(f"{path}: malformed GGUF metadata ({type(e).__name__}: {e})") from None
        except ValueError as e:
            raise ConfigError(f"{path}: {e}") from None


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------
def _ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, (list, tuple)):
        return tuple(int(x) for x in v if x is not None)
    return (int(v),)


def _opt_int(v) -> int | None:
    return None if v is None else int(v)


def _opt_float(v) -> float | None:
    return None if v is None else float(v)


def _dtype_name(v) -> str | None:
    if v is None:
        return None
    s = str(v)
    return s[len("torch."):] if s.startswith("torch.") else s


def _is_nested_rope(rp: dict, layer_type_names: Iterable[str]) -> bool:
    names = set(layer_type_names) | {FULL_ATTENTION, SLIDING_ATTENTION}
    return bool(rp) and all(isinstance(v, dict) or v is None for v in rp.values()) and any(k in names for k in rp)


def _build_hf(cls, text: dict, get, spec, model_type: str, architecture: str):
    family = spec.family
    hidden = int(get("hidden_size"))
    heads = int(get("num_attention_heads"))
    n_layers = int(get("num_hidden_layers"))
    if hidden <= 0 or heads <= 0 or n_layers <= 0:
        raise ValueError(f"hidden_size, num_attention_heads and num_hidden_layers must be positive "
                         f"(got {hidden}, {heads}, {n_layers})")
    kv_heads = int(get("num_key_value_heads", default=heads) or heads)
    head_dim = get("head_dim")
    head_dim = int(head_dim) if head_dim else hidden // heads
    max_pos = int(get("max_position_embeddings"))

    # sliding window
    sliding_window = get("sliding_window")
    if spec.sliding_window_opt_in and not get("use_sliding_window", default=False):
        sliding_window = None
    sliding_window = _opt_int(sliding_window) or None
    layer_types = [str(x) for x in text.get("layer_types") or []] or spec.hf_layer_types(get, n_layers, sliding_window)
    if not layer_types:
        layer_types = [SLIDING_ATTENTION if sliding_window is not None else FULL_ATTENTION] * n_layers
    if SLIDING_ATTENTION not in layer_types:
        sliding_window = None  # a window no layer uses

    # RoPE
    rp = text.get("rope_parameters")
    legacy = text.get("rope_scaling")
    top_theta = text.get("rope_theta")
    prf = text.get("partial_rotary_factor", text.get("rope_pct"))
    top_orig = text.get("original_max_position_embeddings")
    rope_local = None
    if isinstance(rp, dict) and _is_nested_rope(rp, layer_types):
        full = rp.get(FULL_ATTENTION) or {}
        sliding = rp.get(SLIDING_ATTENTION)
        default_theta = top_theta if top_theta is not None else get("rope_theta")
        prf = full.get("partial_rotary_factor", prf)
        rope = RopeConfig.from_hf(full, max_position_embeddings=max_pos, theta=default_theta,
                                  original_max_position_embeddings=top_orig)
        if sliding is not None and SLIDING_ATTENTION in layer_types:
            local_theta = get("rope_local_base_freq", default=default_theta)
            rope_local = RopeConfig.from_hf(sliding, max_position_embeddings=max_pos, theta=local_theta)
    else:
        params = dict(rp) if isinstance(rp, dict) else {}
        if not params and isinstance(legacy, dict):
            params = dict(legacy)
        elif isinstance(legacy, dict) and legacy.get("rope_type", legacy.get("type")) not in (None, "default"):
            params = {**params, **legacy}
        theta = params.get("rope_theta", top_theta if top_theta is not None else get("rope_theta"))
        prf = params.get("partial_rotary_factor", prf)
        if spec.legacy_rope_local:
            # legacy gemma3: rope_scaling applies to global layers only, rope_local_base_freq to sliding ones
            rope = RopeConfig.from_hf(params, max_position_embeddings=max_pos, theta=theta,
                                      original_max_position_embeddings=top_orig)
            local_theta = float(get("rope_local_base_freq", default=10000.0))
            rope_local = RopeConfig(theta=local_theta, max_position_embeddings=max_pos)
        else:
            rope = RopeConfig.from_hf(params, max_position_embeddings=max_pos, theta=theta,
                                      original_max_position_embeddings=top_orig)
    if prf is None:
        prf = get("partial_rotary_factor", default=1.0)
    prf = float(prf)

    # norms, activations, biases: the common reading, then the family's
    if spec.norm_type == "layer_norm":
        norm_type, norm_eps = "layer_norm", float(get("layer_norm_eps", "norm_eps"))
    else:
        norm_type, norm_eps = "rms_norm", float(get("rms_norm_eps"))
    fields = dict(
        architecture=architecture, family=family, model_type=model_type,
        vocab_size=int(get("vocab_size")), hidden_size=hidden, intermediate_size=int(get("intermediate_size")),
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_pos, rope=rope, rope_local=rope_local, partial_rotary_factor=prf,
        rope_neox=spec.rope_neox, norm_type=norm_type, norm_eps=norm_eps,
        hidden_act=str(get("hidden_activation", "hidden_act")),
        tie_word_embeddings=bool(get("tie_word_embeddings")), qkv_bias=False, o_bias=False, mlp_bias=False,
        qk_norm=False, use_parallel_residual=False, sliding_window=sliding_window, layer_types=layer_types,
        num_experts=0,
        bos_token_id=_opt_int(get("bos_token_id")), eos_token_ids=_ids(get("eos_token_id")),
        pad_token_id=_opt_int(get("pad_token_id")), dtype=_dtype_name(get("dtype", "torch_dtype")),
        source="hf", raw=text,
    )
    spec.hf_config(get, fields)
    return cls(**fields)


def _scalar(v):
    """GGUF per-layer arrays (numpy) that are uniform collapse to a scalar."""
    if v is None or isinstance(v, (int, float, bool, str)):
        return v
    try:
        vals = list(v)
    except TypeError:
        return v
    if not vals:
        return None
    if any(x != vals[0] for x in vals):
        raise ValueError(f"per-layer values {vals} are not supported here")
    return vals[0].item() if hasattr(vals[0], "item") else vals[0]


def _gguf_vector(g, name: str) -> tuple[float, ...] | None:
    if name not in getattr(g, "tensors", {}):
        return None
    import numpy as np

    try:
        arr = np.asarray(g.tensor(name), dtype=np.float64)
    except Exception as e:  # noqa: BLE001 - reported with the file and tensor name
        raise ConfigError(f"{getattr(g, 'path', 'GGUF')}: cannot read tensor {name!r} ({e})") from None
    return tuple(float(x) for x in arr.reshape(-1))


_GGUF_FILE_TYPES = {0: "float32", 1: "float16", 32: "bfloat16"}


def _build_gguf(cls, g, arch: str, spec, path: str):
    family = spec.family
    md = g.metadata
    tensors = getattr(g, "tensors", {}) or {}

    def key(k, default=None, required=False):
        full = f"{arch}.{k}"
        if full in md:
            return _scalar(md[full])
        if required:
            raise ConfigError(f"{path}: missing GGUF metadata key {full!r}")
        return default

    hidden = int(key("embedding_length", required=True))
    n_layers = int(key("block_count", required=True))
    heads = int(key("attention.head_count", required=True))
    kv_heads = int(key("attention.head_count_kv", heads) or heads)
    head_dim = int(key("attention.key_length", hidden // heads))
    max_pos = int(key("context_length", required=True))
    ff = key("feed_forward_length")
    rotary_dim = int(key("rope.dimension_count", head_dim))
    prf = rotary_dim / head_dim

    tokens = md.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens):
        vocab = len(tokens)
    elif key("vocab_size") is not None:
        vocab = int(key("vocab_size"))
    elif "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[0])
    else:
        raise ConfigError(f"{path}: cannot tell the vocabulary size (no tokenizer.ggml.tokens, "
                          f"{arch}.vocab_size or token_embd.weight)")

    # RoPE
    theta = float(key("rope.freq_base", 10000.0))
    stype = key("rope.scaling.type")
    sfactor = key("rope.scaling.factor")
    if sfactor is None:
        sfactor = key("rope.scale_linear")  # old name
    sfactor = float(sfactor) if sfactor else None
    orig = key("rope.scaling.original_context_length")
    orig = int(orig) if orig else None
    attn_factor = key("rope.scaling.attn_factor")
    attn_factor = float(attn_factor) if attn_factor else None
    long_f = _gguf_vector(g, "rope_factors_long.weight")
    short_f = _gguf_vector(g, "rope_factors_short.weight")
    freq_factors = _gguf_vector(g, "rope_freqs.weight")
    if stype is None and sfactor and sfactor != 1.0:
        stype = "linear"  # llama.cpp's default when only a factor is given
    stype = (stype or "none").lower()
    common = dict(theta=theta, max_position_embeddings=max_pos)
    if long_f is not None and short_f is not None:
        rope = RopeConfig(type="longrope", short_factor=short_f, long_factor=long_f,
                          original_max_position_embeddings=orig or max_pos, attention_factor=attn_factor,
                          factor=sfactor if stype == "longrope" else None, **common)
    elif stype == "yarn":
        beta_fast = key("rope.scaling.yarn_beta_fast")
        beta_slow = key("rope.scaling.yarn_beta_slow")
        factor = sfactor or (max_pos / orig if orig else None)
        if attn_factor is not None and factor:  # llama.cpp multiplies it into yarn's own mscale
            attn_factor = attn_factor * (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)
        rope = RopeConfig(type="yarn", factor=factor, original_max_position_embeddings=orig or max_pos,
                          beta_fast=_opt_float(beta_fast), beta_slow=_opt_float(beta_slow),
                          attention_factor=attn_factor, **common)
    elif stype in ("none", "linear"):
        if stype == "linear" and sfactor and sfactor != 1.0:
            rope = RopeConfig(type="linear", factor=sfactor, freq_factors=freq_factors, **common)
        elif freq_factors is not None:  # llama3-style: llama.cpp bakes the scaling into rope_freqs
            rope = RopeConfig(type="llama3", freq_factors=freq_factors, original_max_position_embeddings=orig,
                              **common)
        else:
            rope = RopeConfig(**common)
    else:
        raise ConfigError(f"{path}: unsupported rope scaling type {stype!r} "
                          f"(supported in GGUF: none, linear, yarn, longrope)")

    # layers, sliding windows
    sliding_window = key("attention.sliding_window")
    sliding_window = int(sliding_window) if sliding_window else None
    layer_types = [SLIDING_ATTENTION if sliding_window else FULL_ATTENTION] * n_layers

    # norms
    rms_eps = key("attention.layer_norm_rms_epsilon")
    ln_eps = key("attention.layer_norm_epsilon")
    if spec.norm_type == "layer_norm" or (rms_eps is None and ln_eps is not None):
        norm_type, norm_eps = "layer_norm", float(ln_eps if ln_eps is not None else 1e-5)
    else:
        norm_type, norm_eps = "rms_norm", float(rms_eps if rms_eps is not None else 1e-6)

    # biases / qk-norm from the tensors present
    def has(t):
        return f"blk.0.{t}" in tensors

    qkv_bias = has("attn_q.bias") or has("attn_qkv.bias")
    o_bias = has("attn_output.bias")
    qk_norm = has("attn_q_norm.weight")
    tie = "output.weight" not in tensors

    eos = md.get("tokenizer.ggml.eos_token_id")
    eot = md.get("tokenizer.ggml.eot_token_id")
    eos_ids = _ids(eos) + tuple(x for x in _ids(eot) if x not in _ids(eos))

    fields = dict(
        architecture=spec.hf_architectures[0], family=family, model_type=arch,
        vocab_size=vocab, hidden_size=hidden, intermediate_size=None if ff is None else int(ff),
        num_hidden_layers=n_layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        max_position_embeddings=max_pos, rope=rope, rope_local=None, partial_rotary_factor=prf,
        rotary_dim=rotary_dim, rope_neox=spec.rope_neox, norm_type=norm_type, norm_eps=norm_eps,
        hidden_act=spec.gguf_hidden_act, tie_word_embeddings=tie, qkv_bias=qkv_bias, o_bias=o_bias,
        qk_norm=qk_norm, use_parallel_residual=False, sliding_window=sliding_window, layer_types=layer_types,
        num_experts=0, bos_token_id=_opt_int(md.get("tokenizer.ggml.bos_token_id")), eos_token_ids=eos_ids,
        pad_token_id=_opt_int(md.get("tokenizer.ggml.padding_token_id")),
        dtype=_GGUF_FILE_TYPES.get(_opt_int(md.get("general.file_type"))), source="gguf",
        raw={k: v for k, v in md.items() if not k.startswith("tokenizer.")},
    )
    spec.gguf_config(key, md, has, fields)
    if fields["intermediate_size"] is None:
        raise ConfigError(f"{path}: missing GGUF metadata key {arch + '.feed_forward_length'!r}")
    if SLIDING_ATTENTION not in fields["layer_types"]:
        fields["sliding_window"] = None
    return cls(**fields)
