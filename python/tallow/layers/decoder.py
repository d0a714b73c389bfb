"""A generic pre-norm decoder-only transformer; each model file in tallow/models picks its options.

    h = embed(ids) [* sqrt(hidden)]
    for each layer:
        a = attn(attn_norm(h))            [a = attn_post_norm(a)]          Gemma 2/3, GLM-4
        parallel residual (StableLM):  h = h + a + mlp(attn_norm(h))
        else:                          h = h + a;  m = mlp(mlp_norm(h))  [m = mlp_post_norm(m)];  h = h + m
    logits = lm_head(norm(h))             [cap * tanh(logits / cap)]      Gemma 2 (final soft-capping)

The residual stream is carried as (delta, residual) so an RMSNorm adds and normalises in one kernel.

The model is built EMPTY from its config (every parameter allocated on the target device, in the model's
dtype or, through its layer's quantization method, in its stored block type), then weights stream in:
`load_weights(iterable of (name, tensor))` maps each checkpoint name (Hugging Face names; GGUF files
arrive renamed by the loader; a multimodal checkpoint's language model under its prefixes,
layers/names.py) to the layer that declared it, whose weight loader copies it (its shard) in place.
"""
from __future__ import annotations

import math
from typing import Iterable, Optional

import numpy as np

import tallow
from tallow import ops
from tallow.config import FamilyConfig, ModelConfig, RopeConfig
from tallow.layers.attention import AttentionMetadata
from tallow.layers.linear import ParallelLMHead, VocabParallelEmbedding
from tallow.layers.mlp import GatedMLP
from tallow.layers.module import modules
from tallow.layers.names import MissingWeightError, text_name
from tallow.layers.norm import make_norm
from tallow.layers.rotary import build_cos_sin_cache, llama4_attn_scale
from tallow.layers.self_attention import SelfAttention, StepContext

# checkpoint tensors no parameter takes (buffers old transformers saved; GGUF tensors the config read)
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq", "rope_freqs.weight", "rope_factors_long.weight",
                     "rope_factors_short.weight")


class DecoderLayer:
    def __init__(self, attn: SelfAttention, mlp, attn_norm, mlp_norm=None, attn_post_norm=None,
                 mlp_post_norm=None, parallel_residual: bool = False):
        self.attn, self.mlp = attn, mlp
        self.attn_norm, self.mlp_norm = attn_norm, mlp_norm
        self.attn_post_norm, self.mlp_post_norm = attn_post_norm, mlp_post_norm
        self.parallel_residual = parallel_residual

    def __call__(self, h, residual, kv_cache, ctx: StepContext):
        """(delta, residual) in -> (delta, residual) out; the stream's value is residual + delta.
        Layer 0 gets residual None and h = the embeddings."""
        if residual is None:
            residual = h.clone()
            x = self.attn_norm(h)
        else:
            x, residual = self.attn_norm.add_norm(h, residual)
        a = self.attn(x, kv_cache, ctx)
        if self.parallel_residual:
            return ops.add(a, self.mlp(x)), residual
        if self.attn_post_norm is not None:
            a = self.attn_post_norm(a)
        x, residual = self.mlp_norm.add_norm(a, residual)
        m = self.mlp(x)
        if self.mlp_post_norm is not None:
            m = self.mlp_post_norm(m)
        return m, residual


class RopeCaches:
    """One cos/sin cache per distinct RoPE of the model (Gemma 3: local and global), referred to by
    index (layers hold the index, not the tensor, so moving the model to a device moves each cache once).

    LongRoPE (Phi-3) switches from the short to the long factors once a sequence is longer than
    original_max_position_embeddings (transformers picks by the current length). When the context
    allows that, the cache holds both tables, short rows then long rows, and each step indexes the long
    half for the tokens of sequences whose length after the step exceeds the original context. (Keys
    cached before a sequence crosses that length keep their short-factor rotation; transformers
    instead recomputes the whole sequence at the crossing.)"""

    def __init__(self, cfg: ModelConfig, max_positions: int, device: str = "cpu"):
        self.max_positions = int(max_positions)
        self.device = device
        self.rotary_dim = cfg.rotary_dim
        self.caches: list[tallow.Tensor] = []
        self.long_after: list[Optional[int]] = []  # per cache: LongRoPE's original context, when switching
        self._index: dict[RopeConfig, int] = {}

    def index(self, rope: RopeConfig) -> int:
        """The index of `rope`'s cache (built on first use)."""
        i = self._index.get(rope)
        if i is None:
            n = self.max_positions
            orig = rope.original_max_position_embeddings
            switching = rope.type == "longrope" and n > orig
            if switching:
                table = np.concatenate([build_cos_sin_cache(rope, self.rotary_dim, n, seq_len=orig),
                                        build_cos_sin_cache(rope, self.rotary_dim, n, seq_len=n)])
            else:
                table = build_cos_sin_cache(rope, self.rotary_dim, n)
            i = self._index[rope] = len(self.caches)
            cache = tallow.from_numpy(np.ascontiguousarray(table))
            self.caches.append(cache if self.device == "cpu" else cache.to(self.device))
            self.long_after.append(orig if switching else None)
        return i

    def for_step(self, positions: tallow.Tensor, meta: AttentionMetadata) -> list[tuple]:
        """(cache, row of each token in it) per cache index, for this step."""
        out = []
        for cache, orig in zip(self.caches, self.long_after):
            rows = positions
            if orig is not None:
                seq_lens = _host(meta.seq_lens).astype(np.int64)
                counts = np.diff(_host(meta.query_start_loc).astype(np.int64))
                long_tok = np.repeat(seq_lens > orig, counts)
                rows = tallow.from_numpy(np.ascontiguousarray(_host(positions).astype(np.int64)
                                                              + long_tok * self.max_positions))
                if positions.device != "cpu":
                    rows = rows.to(positions.device)
            out.append((cache, rows))
        return out


def _host(t: tallow.Tensor) -> np.ndarray:
    return np.asarray((t if t.device == "cpu" else t.to("cpu")).numpy())


class DecoderForCausalLM(FamilyConfig):
    """Base of the dense model files. Subclasses set the class attributes below (Hugging Face norm names
    under model.layers.N.; None where the family has no such norm), the family's FamilyConfig attributes
    (names, defaults, GGUF tensor names: tallow/config.py) and may override `qk_norm_kind` / `make_mlp`."""

    attn_norm = "input_layernorm"
    attn_post_norm: Optional[str] = None
    mlp_norm = "post_attention_layernorm"
    mlp_post_norm: Optional[str] = None
    gemma_norms = False  # RMSNorms multiply by (1 + w)
    embed_scale = False  # embeddings * sqrt(hidden_size)

    def __init__(self, cfg: ModelConfig, dtype=tallow.float32, max_positions: Optional[int] = None, *,
                 device: str = "cpu", quant_config=None, tp_rank: int = 0, tp_size: int = 1):
        self.cfg = cfg
        self.dtype = dtype
        self.device = device
        self.quant_config = quant_config
        self.tp_rank, self.tp_size = tp_rank, tp_size
        common = dict(dtype=dtype, device=device, quant_config=quant_config, tp_rank=tp_rank, tp_size=tp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, prefix="model.embed_tokens",
                                                   **common)
        self.embed_multiplier = None
        if self.embed_scale:  # transformers rounds sqrt(hidden) to the model dtype first
            s = tallow.tensor(np.array([math.sqrt(cfg.hidden_size)], np.float32), dtype=dtype)
            self.embed_multiplier = float(np.asarray(s.to(tallow.float32).numpy())[0])

        max_positions = int(max_positions or cfg.max_position_embeddings)
        self.rope_caches = RopeCaches(cfg, max_positions, device)
        self.q_scale_table = None
        beta = cfg.rope.llama_4_scaling_beta
        if beta:
            orig = cfg.rope.original_max_position_embeddings or cfg.max_position_embeddings
            table = llama4_attn_scale(np.arange(max_positions), beta, orig).reshape(-1, 1)
            t = tallow.from_numpy(np.ascontiguousarray(table))
            t = t if t.dtype == dtype else t.to(dtype)
            self.q_scale_table = t if device == "cpu" else t.to(device)

        self.layers = [self.make_layer(i) for i in range(cfg.num_hidden_layers)]
        self.norm = self.make_norm("model.norm")
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, self.lm_head_bias, prefix="lm_head",
                                      tied_to=self.embed_tokens if cfg.tie_word_embeddings else None, **common)
        self._params: Optional[dict] = None

    lm_head_bias = False  # Phi-2's lm_head has a bias

    # -- building ---------------------------------------------------------------------------------
    @property
    def norm_kind(self) -> str:
        if self.cfg.norm_type == "layer_norm":
            return "layer_norm"
        return "gemma_rms_norm" if self.gemma_norms else "rms_norm"

    def qk_norm_kind(self) -> Optional[str]:
        return self.norm_kind if self.cfg.qk_norm else None

    def make_norm(self, name: str):
        kind = self.norm_kind
        return make_norm(kind, self.cfg.hidden_size, self.cfg.norm_eps, bias=kind == "layer_norm", prefix=name,
                         dtype=self.dtype, device=self.device)

    def make_attention(self, i: int) -> SelfAttention:
        rope = self.rope_caches.index(self.cfg.rope_for_layer(i))
        return SelfAttention(self.cfg, f"model.layers.{i}.self_attn.", i, self.dtype, self.device, self.quant_config,
                             rope, self.qk_norm_kind(), self.tp_rank, self.tp_size)

    def make_mlp(self, i: int):
        cfg = self.cfg
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, cfg.mlp_bias,
                        prefix=f"model.layers.{i}.mlp.", dtype=self.dtype, device=self.device,
                        quant_config=self.quant_config, tp_rank=self.tp_rank, tp_size=self.tp_size)

    def make_layer(self, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        parallel = self.cfg.use_parallel_residual

        def norm(name):
            return None if name is None else self.make_norm(p + name)

        return DecoderLayer(self.make_attention(i), self.make_mlp(i), norm(self.attn_norm),
                            None if parallel else norm(self.mlp_norm), norm(self.attn_post_norm),
                            norm(self.mlp_post_norm), parallel)

    # -- loading ----------------------------------------------------------------------------------
    def checkpoint_map(self) -> dict:
        """{checkpoint tensor name: (layer, parameter, shard id)} over every layer."""
        if self._params is None:
            self._params = {}
            for m in modules(self):
                for name, (param, shard) in m.checkpoint_map().items():
                    self._params[name] = (m, param, shard)
        return self._params

    def load_weights(self, weights: Iterable) -> set[str]:
        """Load (name, tensor) pairs, one at a time, into the parameters that declared them; returns the
        names loaded. Raises MissingWeightError naming the first weight the checkpoint lacked."""
        params = self.checkpoint_map()
        prefixes = {n.rsplit(".", 1)[0] for n in params}
        loaded = set()
        for name, tensor in weights:
            name = text_name(name)
            if name is None:
                continue  # another tower of a multimodal checkpoint
            target = params.get(name)
            if target is None:
                if name.endswith(_IGNORED_SUFFIXES) or (name.startswith("lm_head.") and self.lm_head.tied):
                    continue
                if name.rsplit(".", 1)[0] in prefixes:
                    raise ValueError(f"the checkpoint has {name!r}, which this {self.cfg.family} config does not "
                                     f"declare (a bias the config.json does not mention?)")
                continue
            module, param, shard = target
            try:
                module.weight_loader(param, tensor, shard)
            except ValueError as e:
                msg = str(e)
                raise ValueError(msg if msg.startswith(name.rsplit(".", 1)[0]) else f"{name}: {msg}") from None
            loaded.add(name)
        if not self.lm_head.tied and "lm_head.weight" not in loaded and "model.embed_tokens.weight" in loaded:
            self.lm_head.tie(self.embed_tokens)  # an untied config whose checkpoint has no lm_head: tie
            self._params = None
        self.check_loaded()
        for m in modules(self):
            m.process_weights_after_loading()
        return loaded

    def check_loaded(self) -> None:
        for m in modules(self):
            missing = m.missing()
            if missing:
                raise MissingWeightError(f"the checkpoint has no weight {missing[0]!r} (a different architecture, "
                                         f"or an incomplete download?)")

    # -- running ----------------------------------------------------------------------------------
    def forward(self, input_ids: tallow.Tensor, positions: tallow.Tensor, kv_caches, meta: AttentionMetadata):
        h = self.embed_tokens(input_ids)
        if self.embed_multiplier is not None:
            h = ops.scale(h, self.embed_multiplier)
        q_scale = None
        if self.q_scale_table is not None:
            q_scale = ops.embedding(positions, self.q_scale_table)
            q_scale = q_scale.view(q_scale.shape[0], 1, 1)
        ctx = StepContext(positions, meta, self.rope_caches.for_step(positions, meta), q_scale)
        residual = None
        for layer, cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cache, ctx)
        if residual is None:  # no layers
            return self.norm(h)
        return self.norm.add_norm(h, residual)[0]

    def compute_logits(self, hidden: tallow.Tensor) -> tallow.Tensor:
        logits = self.lm_head(hidden)
        cap = self.cfg.final_logit_softcapping
        if cap:
            # No tanh kernel yet: soft-cap on the host (the runner copies logits there anyway), and hand the
            # result back on the logits' device.
            arr = _host(logits if logits.dtype == tallow.float32 else logits.to(tallow.float32))
            capped = tallow.from_numpy(np.ascontiguousarray(np.tanh(arr / np.float32(cap)) * np.float32(cap)))
            logits = capped if logits.device == "cpu" else capped.to(logits.device)
        return logits
