"""GGUF tensors under Hugging Face weight names, in Hugging Face layout.

llama.cpp's convert_hf_to_gguf renames tensors (``blk.N.attn_q.weight`` for
``model.layers.N.self_attn.q_proj.weight``), stacks MoE experts into one 3-D tensor per
projection, and for some architectures changes values:

- llama (and the models converted as llama: mistral, yi, mixtral, ...): the rows of q_proj and
  k_proj (weights and biases) are permuted from HF's rotate-half RoPE layout to interleaved pairs
  (``LlamaModel.permute``). Undone here by permuting rows back; a row is a run of whole
  quantization blocks, so this is exact for quantized tensors too.
- gemma2, gemma3: every ``*norm.weight`` is stored as ``1 + w`` (llama.cpp's RMSNorm has no
  offset). Undone by subtracting 1 in float32, so the weights mean what HF's (1 + w) norms expect.
- stablelm: per-head q/k LayerNorms (``q_layernorm.norms.H``) are stacked; split back per head.
- glm4 with M-RoPE sections (GLM-4V): q/k rows are reordered to NeoX order (``normal_to_neox``);
  undone.

Everything else is a zero-copy view of the mapped file. Architectures whose convert does no
permutation (qwen2/3, qwen2moe/3moe, phi3, gemma2/3, stablelm, glm4) keep their q/k as stored.

Which family needs which fix, and its tensor names, is declared in the family's file
(tallow/models/<family>.py: gguf_tensor_names, gguf_permuted_qk, gguf_norm_shifted, rope_neox) and read
through the registry; this module holds llama.cpp's common names and the fixes themselves. Tensors stay
in their stored (block) types: the model's GGUF quantization method keeps them so.
"""
from __future__ import annotations

import os
import re
from typing import Any, Callable

import numpy as np

from tallow.loader.gguf_reader import GGUFError, GGUFFile


class GGUFWeightsError(GGUFError):
    """A GGUF file whose tensors cannot be mapped to a supported model; names file and problem."""


# llama.cpp's per-layer tensor names shared by the llama-like families: GGUF suffix -> HF suffix (under
# model.layers.N.). Each family's file (tallow/models/<family>.py, `gguf_tensor_names`) builds its map from
# these; the maps, the GGUF architectures and the layout fixes each family needs are read from the
# registry (tallow.models.registry).
COMMON_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
MOE_LAYER = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
    "ffn_up_exps": "mlp.experts.{e}.up_proj",
    "ffn_down_exps": "mlp.experts.{e}.down_proj",
}
SHARED_EXPERT_LAYER = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
GLOBAL_MAP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors that are not HF weights but carry model data (RoPE frequency factors): kept under
# their GGUF names so the config (and model code) can find them.
PASSTHROUGH = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


def _family(arch: str):
    from tallow.models import registry

    return registry.family_for_gguf(arch)


def _layer_maps() -> dict[str, dict[str, str]]:
    from tallow.models import registry

    out = {}
    for f in registry.families():
        out.update(registry.model_class(f).gguf_tensor_names)
    return out


def supported_architectures() -> tuple[str, ...]:
    """The GGUF architectures some family file maps (the registry's, computed on use: the family files
    import this module)."""
    return tuple(_layer_maps())


_LAYER_RE = re.compile(r"^blk\.(\d+)\.(.+)\.(weight|bias)$")


def hf_name(arch: str, gguf_name: str, layer_map: dict[str, str] | None = None) -> str | None:
    """The HF weight name for a GGUF tensor name (None when unknown). Expert and per-head names
    keep a ``{e}`` / ``{h}`` placeholder. `layer_map`: the family's map (default: the registry's for `arch`)."""
    if layer_map is None:
        layer_map = _layer_maps().get(arch)
    if layer_map is None:
        return None
    if gguf_name in PASSTHROUGH:
        return gguf_name
    m = _LAYER_RE.match(gguf_name)
    if m:
        target = layer_map.get(m.group(2))
        return None if target is None else f"model.layers.{m.group(1)}.{target}.{m.group(3)}"
    base, _, kind = gguf_name.rpartition(".")
    target = GLOBAL_MAP.get(base)
    return None if target is None or kind not in ("weight", "bias") else f"{target}.{kind}"


# -- layout fixes ---------------------------------------------------------------------------------
def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of convert_hf_to_gguf's ``LlamaModel.permute`` along the first axis: GGUF stores
    each head's rows as interleaved pairs (r0, r_half, r1, r_half+1, ...); HF has the halves
    contiguous. Works on any per-row layout (float elements or rows of quantized blocks)."""
    n = rows.shape[0]
    if n % (2 * n_head):
        raise ValueError(f"{n} rows do not split into {n_head} heads of pairs")
    return np.ascontiguousarray(
        rows.reshape(n_head, n // n_head // 2, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape))


def permute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute`` (HF layout -> GGUF layout), for tests and tools."""
    n = rows.shape[0]
    return np.ascontiguousarray(
        rows.reshape(n_head, 2, n // n_head // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape))


def neox_to_normal_rows(rows: np.ndarray, head_dim: int, rotary_dim: int) -> np.ndarray:
    """Inverse of Glm4Model.normal_to_neox: within each head, the first `rotary_dim` rows hold
    the even then the odd rotary rows; put them back interleaved."""
    n = rows.shape[0]
    r = rows.reshape(n // head_dim, head_dim, *rows.shape[1:])
    out = r.copy()
    half = rotary_dim // 2
    out[:, 0:rotary_dim:2] = r[:, :half]
    out[:, 1:rotary_dim:2] = r[:, half:rotary_dim]
    return np.ascontiguousarray(out.reshape(rows.shape))


def _meta_int(gguf: GGUFFile, key: str, layer: int, default: int | None = None) -> int | None:
    v = gguf.get(key, default)
    if v is None:
        return None
    if isinstance(v, np.ndarray):  # per-layer arrays (e.g. head_count_kv of hybrid models)
        v = v[layer] if v.ndim and layer < len(v) else v.flat[0]
    return int(v)


class GGUFWeights:
    """Maps one GGUF file's tensors to HF names. ``weights()`` returns {HF name: tallow Tensor};
    ``names()`` {HF name: GGUF name} without touching data. Raises GGUFWeightsError for an
    unsupported architecture or a tensor name this architecture does not have."""

    def __init__(self, gguf: GGUFFile | str | os.PathLike, family=None):
        """`family`: the model class whose GGUF names apply (default: the registry's for the file's
        general.architecture)."""
        self.gguf = gguf if isinstance(gguf, GGUFFile) else GGUFFile(gguf)
        arch = self.gguf.architecture
        if arch is None:
            raise GGUFWeightsError(f"{self.gguf.path}: no general.architecture in the GGUF metadata")
        if family is None:
            family = _family(arch)
        layer_map = None if family is None else family.gguf_tensor_names.get(arch)
        if layer_map is None:
            raise GGUFWeightsError(f"{self.gguf.path}: GGUF architecture {arch!r} is not supported "
                                   f"(supported: {', '.join(_layer_maps())})")
        self.arch = arch
        self.family = family
        self.layer_map = layer_map

    # metadata helpers
    def _heads(self, layer: int) -> tuple[int, int]:
        g, a = self.gguf, self.arch
        n_head = _meta_int(g, f"{a}.attention.head_count", layer)
        if n_head is None:
            raise GGUFWeightsError(f"{g.path}: {a}.attention.head_count is missing from the metadata")
        n_kv = _meta_int(g, f"{a}.attention.head_count_kv", layer, n_head)
        return n_head, n_kv

    def _plan(self) -> list[tuple[str, str, Callable[[], Any]]]:
        """(HF name, GGUF name, loader) for every tensor, in file order."""
        g, arch = self.gguf, self.arch
        plan = []
        for gname, info in g.tensors.items():
            target = hf_name(arch, gname, self.layer_map)
            if target is None:
                raise GGUFWeightsError(f"{g.path}: tensor {gname!r} is not a known {arch} weight")
            m = _LAYER_RE.match(gname)
            layer = int(m.group(1)) if m else -1
            kind = m.group(2) if m else ""
            if "{e}" in target:  # stacked experts -> one HF tensor per expert
                n_exp = info.shape[0] if len(info.shape) == 3 else 0
                if n_exp == 0:
                    raise GGUFWeightsError(f"{g.path}: expert tensor {gname!r} has shape {info.shape}, not 3-D")
                for e in range(n_exp):
                    plan.append((target.format(e=e), gname, lambda gname=gname, e=e: self._slice(gname, e)))
            elif "{h}" in target:  # stacked per-head norms (stablelm)
                if len(info.shape) != 2:
                    raise GGUFWeightsError(f"{g.path}: per-head norm {gname!r} has shape {info.shape}, not 2-D")
                for h in range(info.shape[0]):
                    plan.append((target.format(h=h), gname, lambda gname=gname, h=h: self._slice(gname, h)))
            else:
                plan.append((target, gname, lambda gname=gname, target=target, layer=layer, kind=kind:
                             self._load(gname, target, layer, kind)))
        return plan

    def names(self) -> dict[str, str]:
        return {hf: gname for hf, gname, _ in self._plan()}

    def dtypes(self) -> dict[str, Any]:
        """{HF name: tallow dtype as stored} without reading tensor data (quantization configs use it)."""
        return {hf: self.gguf.dtype(gname) for hf, gname, _ in self._plan()}

    def iter_weights(self, progress: bool = False):
        """(HF name, tensor) pairs one at a time, in file order (a tensor whose layout is fixed is copied
        only while it is loaded)."""
        plan = self._plan()
        it = plan
        if progress:
            from huggingface_hub.utils import tqdm

            it = tqdm(plan, desc=f"Loading {os.path.basename(self.gguf.path)}", unit="tensor")
        for hf, _, load in it:
            yield hf, load()

    def weights(self, progress: bool = False) -> dict[str, Any]:
        return dict(self.iter_weights(progress))

    # loaders
    def _slice(self, gname: str, i: int):
        from tallow import _core

        info = self.gguf.tensors[gname]
        return _core.from_buffer(self.gguf.raw(gname)[i], self.gguf.dtype(gname), list(info.shape[1:]))

    def _load(self, gname: str, target: str, layer: int, kind: str):
        from tallow import _core

        g, arch = self.gguf, self.arch
        info = g.tensors[gname]
        fam = self.family
        if fam.gguf_norm_shifted and gname.endswith("norm.weight"):
            w = np.asarray(g.tensor(gname).to("float32").numpy(), dtype=np.float32) - np.float32(1.0)
            return _core.from_numpy(w)
        fix = None
        if kind in ("attn_q", "attn_k") and fam.gguf_permuted_qk:
            n_head, n_kv = self._heads(layer)
            heads = n_head if kind == "attn_q" else n_kv
            fix = lambda rows: unpermute_rows(rows, heads)  # noqa: E731
        elif kind in ("attn_q", "attn_k") and not fam.rope_neox and f"{arch}.rope.dimension_sections" in g.metadata:
            n_head, n_kv = self._heads(layer)
            head_dim = _meta_int(g, f"{arch}.attention.key_length", layer) or (
                _meta_int(g, f"{arch}.embedding_length", layer) // n_head)
            rot = _meta_int(g, f"{arch}.rope.dimension_count", layer) or head_dim // 2
            fix = lambda rows: neox_to_normal_rows(rows, head_dim, rot)  # noqa: E731
        elif kind == "ffn_gate_inp_shexp" and len(info.shape) == 1:
            return g.tensor(gname).view([1, info.shape[0]])  # HF: Linear(hidden, 1).weight
        if fix is None:
            return g.tensor(gname)
        raw = g.raw(gname)  # [rows, bytes per row] (or [n] bytes for a 1-D bias)
        if raw.ndim == 1:  # 1-D bias: rows of one element
            itemsize = raw.shape[0] // info.shape[0]
            raw = raw.reshape(info.shape[0], itemsize)
        try:
            fixed = fix(raw)
        except ValueError as e:
            raise GGUFWeightsError(f"{g.path}: cannot undo the q/k permutation of {gname!r} "
                                   f"(shape {info.shape}): {e}") from None
        return _core.from_buffer(fixed.reshape(-1), g.dtype(gname), list(info.shape))


def load_gguf_weights(gguf: GGUFFile | str | os.PathLike, progress: bool = False) -> dict[str, Any]:
    """{HF weight name: tallow Tensor} for a GGUF file (see the module docstring for the layout fixes)."""
    return GGUFWeights(gguf).weights(progress=progress)


def gguf_to_hf_names(gguf: GGUFFile | str | os.PathLike) -> dict[str, str]:
    """{HF weight name: GGUF tensor name}; reads only the header."""
    return GGUFWeights(gguf).names()
