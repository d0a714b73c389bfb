"""In-situ quantization (`--isq q4k`, `LLM(..., quantization="q4k")`): float checkpoint weights are
quantized to a GGUF block type while they load, on the device they will run on, one checkpoint tensor
at a time (the float tensor goes to the device, `ops.quantize` runs there, only the block tensor is
kept), so the peak is about one float tensor above the quantized model. The layers then compute as
GGUF layers do (GGUFLinearMethod / GGUFEmbeddingMethod): only how the weights load differs.

The same per-tensor type choice (`QuantScheme.tensor_type`) drives `tallow quantize`
(loader/gguf_export.py), so `--isq T` and a GGUF written with `--type T` hold the same blocks.

Which type each tensor takes (llama.cpp's llama_tensor_get_type, src/llama-quant.cpp):
- every decoder Linear (q, k, v, o, gate, up, down, MoE experts): the scheme's type;
- the output (lm_head, or the token embedding when it is tied and acts as the output): Q6_K, except
  Q8_0 for a Q8_0 scheme or when the row length is not a multiple of the scheme type's block;
- the token embedding (untied): the scheme's type;
- the llama.cpp mixes (`tallow quantize --type q4_k_m`, q4_k_s, q5_k_m, q5_k_s, q3_k_s/m/l) bump
  attn_v, ffn_down and attn_output on the layers llama.cpp picks (see `_mix_type`);
- a row length that is not a multiple of the chosen block falls back as llama.cpp does (Q2_K/Q3_K ->
  Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL; F16 when even that block does not
  divide it; F16 too for the 32-element types, which have no fallback), with one log line. A float16
  fallback is stored in the model's dtype with its values rounded through float16 (what the GGUF holds);
- norms, biases and routers stay float.
"""
from __future__ import annotations

import dataclasses
import logging
import re
from typing import Optional

import tallow
from tallow import ops
from tallow.layers.quantization.base import QuantizationConfig, QuantizeMethodBase
from tallow.layers.quantization.gguf import GGUFEmbeddingMethod, GGUFLinearMethod
from tallow.layers.quantization.unquantized import UnquantizedEmbeddingMethod, UnquantizedLinearMethod

log = logging.getLogger("tallow.isq")

# elements per block of each block type this module may choose
BLOCK_SIZE = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "iq4_nl": 32,
              "q2_k": 256, "q3_k": 256, "q4_k": 256, "q5_k": 256, "q6_k": 256, "iq4_xs": 256}
FLOAT16 = "float16"  # the last-resort fallback: the tensor stays float

# llama.cpp's tensor_type_fallback
_FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0", "iq4_xs": "iq4_nl"}

# --isq names (candle-vllm's, plus the q2_k..q6_k spellings): uniform schemes
ISQ_TYPES = {"q4_0": "q4_0", "q4_1": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q8_0": "q8_0",
             "q2k": "q2_k", "q3k": "q3_k", "q4k": "q4_k", "q5k": "q5_k", "q6k": "q6_k",
             "q2_k": "q2_k", "q3_k": "q3_k", "q4_k": "q4_k", "q5_k": "q5_k", "q6_k": "q6_k"}
ISQ_NAMES = ("q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k")

# llama.cpp's general.file_type (LLAMA_FTYPE_MOSTLY_*) of each scheme
_FTYPE = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_s": 11, "q3_k_m": 12,
          "q3_k_l": 13, "q4_k_s": 14, "q4_k_m": 15, "q5_k_s": 16, "q5_k_m": 17, "q6_k": 18, "iq4_nl": 25,
          "iq4_xs": 30}
# uniform K-quant schemes are written as llama.cpp's "_S" file types (no per-tensor bumps)
_UNIFORM_FTYPE = {"q3_k": 11, "q4_k": 14, "q5_k": 16}
# `tallow quantize --type` names beyond the --isq ones: llama.cpp's mixes and the IQ4 types
MIX_TYPES = ("q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m")
EXPORT_NAMES = ISQ_NAMES + MIX_TYPES + ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_nl", "iq4_xs")


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    """A quantization recipe: `base` (a tallow block dtype name) for the weights, `mix` one of
    llama.cpp's per-tensor mixes (None: uniform), `name` as the user spelled it."""

    name: str
    base: str
    mix: Optional[str] = None

    @property
    def file_type(self) -> int:
        """llama.cpp's general.file_type value."""
        if self.mix:
            return _FTYPE[self.mix]
        return _UNIFORM_FTYPE.get(self.base, _FTYPE.get(self.base, 0))

    def tensor_type(self, role: str, layer: int, n_layers: int, k: int, name: str, *, n_gqa: int = 1,
                    n_expert: int = 0, logged: Optional[set] = None) -> str:
        """The dtype name (a block type, or "float16" as the last fallback) of one weight. role: the GGUF
        tensor kind ("token_embd", "output" (also a tied embedding), "attn_q", "attn_v", "ffn_down",
        "ffn_down_exps", ...); layer: its block index (-1 for global tensors); k: its row length."""
        t = self.base
        if role == "output":
            t = "q8_0" if (k % BLOCK_SIZE[t] or t == "q8_0") else "q6_k"
        elif role != "token_embd" and self.mix:
            t = _mix_type(self.mix, t, role, layer, n_layers, n_gqa, n_expert)
        return fallback_type(t, k, name, logged)


def _mix_type(mix: str, t: str, role: str, i: int, n: int, n_gqa: int, n_expert: int) -> str:
    """llama.cpp's llama_tensor_get_type_impl for the K-quant mixes (dense and MoE layers; not its
    Falcon, 70B or IQ-mix special cases)."""
    if role in ("attn_v", "attn_qkv"):
        if n_expert == 8:
            return "q8_0"
        if mix == "q3_k_m":
            return "q5_k" if i < 2 else "q4_k"
        if mix == "q3_k_l":
            return "q5_k"
        if mix in ("q4_k_m", "q5_k_m") and _use_more_bits(i, n):
            return "q6_k"
        if mix == "q4_k_s" and i < 4:
            return "q5_k"
        return t
    if role == "attn_k" and n_expert == 8:
        return "q8_0"
    if role.startswith("ffn_down"):
        if mix == "q3_k_m":
            return "q5_k" if i < n // 16 else "q4_k"
        if mix == "q3_k_l":
            return "q5_k"
        if mix == "q4_k_m" and _use_more_bits(i, n):
            return "q6_k"
        if mix == "q5_k_m" and _use_more_bits(i, n):
            return "q6_k"
        if mix == "q4_k_s" and i < n // 8:
            return "q5_k"
        return t
    if role == "attn_output":
        if n_expert == 8 and mix in ("q3_k_s", "q3_k_m", "q4_k_s", "q4_k_m"):
            return "q5_k"
        if n_expert != 8 and mix == "q3_k_m":
            return "q4_k"
        if n_expert != 8 and mix == "q3_k_l":
            return "q5_k"
    return t


def fallback_type(t: str, k: int, name: str, logged: Optional[set] = None) -> str:
    """`t`, or llama.cpp's fallback when rows of `k` elements are not whole blocks of `t`: one log line
    per (type, row length), naming the first tensor (`logged` remembers which were told)."""
    if k % BLOCK_SIZE[t] == 0:
        return t
    fb = _FALLBACK.get(t, FLOAT16)
    if fb != FLOAT16 and k % BLOCK_SIZE[fb]:
        fb = FLOAT16
    if logged is None or (t, k) not in logged:
        log.warning("%s: row length %d is not a multiple of %d (%s): falling back to %s%s", name, k, BLOCK_SIZE[t],
                    t, fb, "" if logged is None else " (and for every such tensor)")
        if logged is not None:
            logged.add((t, k))
    return fb


def isq_scheme(name) -> QuantScheme:
    """The scheme of an --isq value (ValueError listing the valid ones)."""
    key = str(name).strip().lower()
    if key not in ISQ_TYPES:
        raise ValueError(f"--isq {name}: unknown in-situ quantization type; valid: {', '.join(ISQ_NAMES)} "
                         f"(q2_k..q6_k spellings too)")
    return QuantScheme(key, ISQ_TYPES[key])


def export_scheme(name) -> QuantScheme:
    """The scheme of a `tallow quantize --type` value: the --isq names (uniform), llama.cpp's mixes
    (q4_k_m, ...) and iq4_nl / iq4_xs (ValueError listing the valid ones)."""
    key = str(name).strip().lower()
    if key in ISQ_TYPES:
        return QuantScheme(key, ISQ_TYPES[key])
    if key in MIX_TYPES:
        return QuantScheme(key, key[:4], key)
    if key in ("iq4_nl", "iq4_xs"):
        return QuantScheme(key, key)
    raise ValueError(f"--type {name}: unknown quantization type; valid: {', '.join(EXPORT_NAMES)}")


# -- which tensor is which ------------------------------------------------------------------------
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)\.weight$")


def _gguf_kinds(family_cls) -> dict[str, str]:
    """{Hugging Face suffix under model.layers.N.: GGUF tensor kind} of the family (its own map, else the
    common llama one)."""
    from tallow.loader.gguf_weights import COMMON_LAYER, MOE_LAYER, SHARED_EXPERT_LAYER

    maps = getattr(family_cls, "gguf_tensor_names", None) or {}
    names = dict(next(iter(maps.values()))) if maps else {**COMMON_LAYER, **MOE_LAYER, **SHARED_EXPERT_LAYER}
    out = {}
    for kind, hf in names.items():
        out[hf.replace("{e}", r"\d+")] = kind
    return out


def tensor_role(hf_weight_name: str, kinds: dict[str, str]) -> tuple[str, int]:
    """(GGUF tensor kind, layer) of a Hugging Face weight name: ("output", -1) for lm_head,
    ("token_embd", -1) for the embedding, ("other", layer) when the family map does not know it."""
    if hf_weight_name.startswith("lm_head."):
        return "output", -1
    if hf_weight_name.startswith("model.embed_tokens."):
        return "token_embd", -1
    m = _LAYER_RE.match(hf_weight_name)
    if not m:
        return "other", -1
    suffix = m.group(2)
    for pattern, kind in kinds.items():
        if re.fullmatch(pattern, suffix):
            return kind, int(m.group(1))
    # a fused checkpoint name (qkv_proj, gate_up_proj): llama.cpp's categories by substring
    if suffix.endswith("qkv_proj"):
        return "attn_qkv", int(m.group(1))
    if suffix.endswith("gate_up_proj"):
        return "ffn_up", int(m.group(1))
    return "other", int(m.group(1))


# -- the quantization config and methods ----------------------------------------------------------
def _quantize_op():
    q = getattr(ops, "quantize", None) or getattr(tallow._core, "quantize", None)
    if q is None:
        raise RuntimeError("in-situ quantization needs tallow.ops.quantize, which this build of tallow lacks")
    return q


def quantize_tensor(src: tallow.Tensor, dtype, device) -> tallow.Tensor:
    """`src` (a checkpoint tensor, any device) quantized to `dtype` on `device`. A block-typed source (a GGUF
    re-typed by `tallow quantize`; --isq refuses GGUF files earlier) is kept as it is when it already has
    `dtype`, else dequantized to float32 first (llama.cpp's --allow-requantize)."""
    x = src if src.is_contiguous() else src.contiguous()
    if x.dtype.is_block:
        if x.dtype == dtype:
            return x if str(x.device) == str(device) else x.to(str(device))
        x = x.to(tallow.float32)
    if str(x.device) != str(device):
        x = x.to(str(device))
    return _quantize_op()(x, dtype)


class ISQConfig(QuantizationConfig):
    """Per layer: the scheme's block type for each part of the weight (tensor_type), the unquantized
    methods where a part falls back to float."""

    name = "isq"

    def __init__(self, scheme: QuantScheme, cfg):
        self.scheme = scheme
        self.cfg = cfg
        from tallow.models import registry

        self._kinds = _gguf_kinds(registry.model_class(cfg.family))
        self.chosen: dict[str, str] = {}  # {Hugging Face weight name: dtype name} (what was picked)
        self._logged: set = set()  # (type, row length) fallbacks already logged

    def weight_type(self, hf_name: str, k: int) -> str:
        role, layer = tensor_role(hf_name, self._kinds)
        if role == "token_embd" and self.cfg.tie_word_embeddings:
            role = "output"  # the tied table is the output too (llama.cpp: quantized as the output)
        cfg = self.cfg
        t = self.scheme.tensor_type(role, layer, cfg.num_hidden_layers, k, hf_name,
                                    n_gqa=max(1, cfg.num_attention_heads // max(1, cfg.num_key_value_heads)),
                                    n_expert=cfg.num_experts, logged=self._logged)
        self.chosen[hf_name] = t
        return t

    def get_linear_method(self, layer) -> QuantizeMethodBase:
        _, parts = layer.checkpoint_weight_names()
        k = layer.input_size_per_partition  # this rank's row length: each rank quantizes its own shard
        if self._is_router(layer):
            return UnquantizedLinearMethod()
        dts = [self.weight_type(n, k) for n in parts]
        if any(d == FLOAT16 for d in dts):
            if all(d == FLOAT16 for d in dts):
                return ISQFloat16LinearMethod()
            dts = [d if d != FLOAT16 else None for d in dts]  # a float part among block parts
        return ISQLinearMethod([None if d is None else tallow._core.dtype(d) for d in dts])

    def get_embedding_method(self, layer) -> QuantizeMethodBase:
        t = self.weight_type(layer.prefix + ".weight", layer.embedding_dim)
        if t == FLOAT16:
            return ISQFloat16EmbeddingMethod()
        return ISQEmbeddingMethod(tallow._core.dtype(t))

    @staticmethod
    def _is_router(layer) -> bool:
        # MoE routers (mlp.gate, shared_expert_gate): llama.cpp keeps ffn_gate_inp float
        return bool(re.search(r"\.mlp\.gate$|shared_expert_gate$|\.block_sparse_moe\.gate$", layer.prefix))


class ISQLinearMethod(GGUFLinearMethod):
    """GGUF blocks, filled by quantizing each float checkpoint tensor as it loads."""

    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        if param == "weight":
            dst_dtype = self._part_dtype(layer, part)
            if dst_dtype.is_block:
                src = quantize_tensor(src, dst_dtype, _device(layer))
            else:  # a part that fell back to float16
                src = _round_f16(src)
        super().load(layer, param, src, row_offset, part)

    def _part_dtype(self, layer, part):
        if layer.weight_parts is None:
            return layer.weight.dtype
        return layer.weight_parts[0 if part is None else part].dtype


class ISQEmbeddingMethod(GGUFEmbeddingMethod):
    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        dst = getattr(layer, param)
        if dst.dtype.is_block:
            src = quantize_tensor(src, dst.dtype, dst.device)
        super().load(layer, param, src, row_offset, part)


class ISQFloat16LinearMethod(UnquantizedLinearMethod):
    """A layer whose rows fit no block type: float16 values (as the GGUF stores them) in the model's dtype."""

    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        super().load(layer, param, _round_f16(src) if param == "weight" else src, row_offset, part)


class ISQFloat16EmbeddingMethod(UnquantizedEmbeddingMethod):
    def load(self, layer, param: str, src: tallow.Tensor, row_offset: int = 0, part: Optional[int] = None) -> None:
        super().load(layer, param, _round_f16(src), row_offset, part)


def _round_f16(src: tallow.Tensor) -> tallow.Tensor:
    if src.dtype == tallow.float16:
        return src
    x = src if src.is_contiguous() else src.contiguous()
    return (x.to(tallow.float32) if x.dtype.is_block else x).to(tallow.float16)


def _device(layer):
    w = layer.weight if layer.weight is not None else layer.weight_parts[0]
    return w.device


def isq_config(name, cfg) -> ISQConfig:
    """The quantization config for `--isq name` on a model of `cfg` (ValueError for an unknown name)."""
    return ISQConfig(isq_scheme(name), cfg)


def with_progress(weights, source, config: ISQConfig):
    """`weights` ((name, tensor) pairs) behind a progress bar of the tensors quantized so far."""
    try:
        total = len(source.checkpoint()) if source.kind == "safetensors" else len(source.gguf.tensors)
    except Exception:  # noqa: BLE001 - the bar just has no total
        total = None
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover - tqdm is a dependency
        from huggingface_hub.utils import tqdm
    yield from tqdm(weights, total=total, desc=f"Quantizing to {config.scheme.name}", unit="tensor")
