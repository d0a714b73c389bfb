"""The linear layers a model declares, in the manner of vLLM's model_executor/layers/linear.py:

    ReplicatedLinear             every rank holds all of W (routers)
    ColumnParallelLinear         W's rows (outputs) split over ranks
    MergedColumnParallelLinear   several column-parallel projections of one input in one GEMM ([gate; up])
    QKVParallelLinear            q, k, v heads in one GEMM; kv heads replicated when ranks outnumber them
    RowParallelLinear            W's columns (inputs) split over ranks; the partial products are
                                 all-reduced, the bias is added by rank 0
    VocabParallelEmbedding       the token table's rows split over ranks
    ParallelLMHead               the output projection over the vocabulary (column-parallel), or the
                                 embedding's table when tied

Each layer holds tp_rank / tp_size and owns its parameters through a quantization method
(layers/quantization): the method creates them for this rank's shard, copies a checkpoint tensor's shard
in, and applies the product. The layer does the shard arithmetic: which rows (or columns) of a
checkpoint tensor belong to this rank and where they go. With tp_size > 1 the row-parallel layers
all-reduce their partial sums, the embedding all-reduces its masked lookups and the lm head all-gathers
the logits, through the process's tensor-parallel group (tallow/parallel).

Checkpoint names: a fused layer loads its parts under their own names (q_proj / k_proj / v_proj,
gate_proj / up_proj: shard ids 0, 1, 2) or, as Phi-3 and GLM-4 store them, all parts in one tensor
under the fused name (shard id None), which is split here by the parts' sizes.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence


import tallow
from tallow import ops
from tallow.layers.module import Module
from tallow.layers.quantization.base import UNQUANTIZED, QuantizationConfig
from tallow.parallel.communicator import get_tp_group


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {d}")
    return n // d


class LinearBase(Module):
    """y = x W^T + b with W [sum(output_sizes), input_size] (this rank's shard of it).

    prefix: the layer's own name (its fused checkpoint name for a fused layer), e.g.
      "model.layers.0.self_attn.qkv_proj".
    part_names: the checkpoint names of the parts (default: [prefix]).
    fused_name: the checkpoint name of all parts in one tensor (default: prefix when there are several parts).
    dummy_names: seed names of each part's rows for dummy weights (default: one seed, prefix, for all rows)."""

    param_names = ("weight", "bias")
    split_output = False  # column-parallel: outputs split over ranks
    split_input = False  # row-parallel: inputs split over ranks

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, *, prefix: str = "",
                 dtype=tallow.float32, device: str = "cpu", quant_config: Optional[QuantizationConfig] = None,
                 part_names: Optional[Sequence[str]] = None, fused_name: Optional[str] = "",
                 dummy_names: Optional[Sequence[str]] = None, tp_rank: int = 0, tp_size: int = 1,
                 create: bool = True):
        super().__init__(prefix)
        self.input_size = int(input_size)
        self.output_sizes = [int(n) for n in output_sizes]
        self.has_bias = bool(bias)
        self.dtype = dtype
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        if not (0 <= self.tp_rank < self.tp_size):
            raise ValueError(f"tp_rank {tp_rank} is not in [0, {tp_size})")
        self.part_names = list(part_names) if part_names else [prefix]
        if len(self.part_names) != len(self.output_sizes):
            raise ValueError(f"{prefix}: {len(self.part_names)} part names for {len(self.output_sizes)} parts")
        self.fused_name = (prefix if len(self.output_sizes) > 1 else None) if fused_name == "" else fused_name
        self.dummy_names = list(dummy_names) if dummy_names else None
        self.input_size_per_partition = (_divide(self.input_size, self.tp_size, f"{prefix} input size")
                                         if self.split_input else self.input_size)
        self.output_partition_sizes = self._partition_sizes()
        self.weight = self.bias = None
        self.weight_parts = None
        if create:
            self.quant_method = (quant_config or UNQUANTIZED).get_linear_method(self)
            self.quant_method.create_weights(self, dtype, device)

    # -- shapes and shards ------------------------------------------------------------------------
    def _partition_sizes(self) -> list[int]:
        if not self.split_output:
            return list(self.output_sizes)
        return [_divide(n, self.tp_size, f"{self.prefix} output size") for n in self.output_sizes]

    def part_shard_start(self, part: int) -> int:
        """First row of this rank's shard within checkpoint part `part`."""
        return self.tp_rank * self.output_partition_sizes[part] if self.split_output else 0

    def part_offset(self, part: int) -> int:
        """First row of part `part` in this rank's weight."""
        return sum(self.output_partition_sizes[:part])

    def checkpoint_weight_names(self) -> tuple[Optional[str], list[str]]:
        """(fused checkpoint name, part checkpoint names) of the weight (quantization configs read
        the checkpoint's dtypes under these)."""
        fused = None if self.fused_name is None else self.fused_name + ".weight"
        return fused, [p + ".weight" for p in self.part_names]

    def checkpoint_map(self) -> dict:
        out = {}
        # a quantized checkpoint's method names its own tensors (qweight, scales, ...) in place of weight
        quantized = getattr(getattr(self, "quant_method", None), "checkpoint_params", None)
        for param in (tuple(quantized) + ("bias",)) if quantized else ("weight", "bias"):
            if param == "bias" and not self.has_bias:
                continue
            if param == "weight" and getattr(self, "tied", False):
                continue
            if len(self.part_names) == 1 and self.fused_name is None:
                out[f"{self.part_names[0]}.{param}"] = (param, None)
                continue
            for i, p in enumerate(self.part_names):
                out[f"{p}.{param}"] = (param, i)
            if self.fused_name is not None:
                out[f"{self.fused_name}.{param}"] = (param, None)
        return out

    def missing(self) -> list[str]:
        out = []
        optional = getattr(getattr(self, "quant_method", None), "optional_params", ())
        for name, (p, s) in self.checkpoint_map().items():
            if (p, s) in self._loaded or (p, None) in self._loaded or p in optional:
                continue
            if s is None and len(self.part_names) > 1 and all((p, i) in self._loaded
                                                               for i in range(len(self.part_names))):
                continue  # the fused name of a layer loaded part by part
            if s is None and len(self.part_names) > 1:
                continue  # reported under its parts' names
            out.append(name)
        return out

    def shard(self, param: str, loaded: tallow.Tensor, part: Optional[int]) -> tuple[tallow.Tensor, int]:
        """(this rank's piece of the checkpoint tensor `loaded` of part `part`, its first row in the
        parameter)."""
        p = 0 if part is None else part
        n = self.output_partition_sizes[p]
        if loaded.ndim == 0 or loaded.shape[0] != self.output_sizes[p]:
            raise ValueError(f"{self.part_names[p]}.{param}: shape {list(loaded.shape)}, the config needs "
                             f"{self.output_sizes[p]} rows")
        src = loaded
        if self.split_output and self.tp_size > 1:
            src = src.narrow(0, self.part_shard_start(p), n)
        if param == "weight" and self.split_input and self.tp_size > 1:
            k = self.input_size_per_partition
            src = src.narrow(1, self.tp_rank * k, k)
        return src, self.part_offset(p)

    def weight_loader(self, param: str, loaded: tallow.Tensor, shard_id=None) -> None:
        part = self._part_index(shard_id)
        collect = getattr(self.quant_method, "collect", None)
        if collect is not None and param != "bias":  # packed tensors: the method shards them once all are in
            collect(self, param, loaded, part)
            self._loaded.add((param, part))
            return
        if part is None and len(self.output_sizes) > 1:  # all parts in one checkpoint tensor
            if loaded.ndim == 0 or loaded.shape[0] != sum(self.output_sizes):
                raise ValueError(f"{self.fused_name}.{param}: shape {list(loaded.shape)}, the config needs "
                                 f"{sum(self.output_sizes)} rows ({' + '.join(map(str, self.output_sizes))})")
            start = 0
            for i, n in enumerate(self.output_sizes):
                src, row = self.shard(param, loaded.narrow(0, start, n), i)
                self.quant_method.load(self, param, src, row, i)
                start += n
            self._loaded.add((param, None))
            return
        src, row = self.shard(param, loaded, part)
        self.quant_method.load(self, param, src, row, part)
        self._loaded.add((param, part))

    def _part_index(self, shard_id) -> Optional[int]:
        if shard_id is None or isinstance(shard_id, int):
            return shard_id
        return {"q": 0, "k": 1, "v": 2}[shard_id]

    def dummy_parts(self) -> Iterator[tuple]:
        if self.weight_parts is not None and not getattr(self, "tied", False):  # parts stored apart (GGUF)
            for i, part in enumerate(self.weight_parts):
                name = f"{self.dummy_names[i]}.weight" if self.dummy_names else f"{self.prefix}.weight.{i}"
                yield part, name, "linear", self.input_size
        if self.weight is not None and not getattr(self, "tied", False):
            if self.dummy_names is None:
                yield self.weight, self.prefix + ".weight", "linear", self.input_size
            else:
                for i, name in enumerate(self.dummy_names):
                    yield (self.weight.narrow(0, self.part_offset(i), self.output_partition_sizes[i]),
                           name + ".weight", "linear", self.input_size)
        if self.bias is not None:
            yield self.bias, self.prefix + ".bias", "bias", self.input_size

    def process_weights_after_loading(self) -> None:
        if self.split_input and self.tp_rank > 0:
            self.bias = None  # row-parallel: rank 0 adds the bias once, before (after) the all-reduce
        self.quant_method.process_weights_after_loading(self)

    # -- running ----------------------------------------------------------------------------------
    def __call__(self, x: tallow.Tensor, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        return self.quant_method.apply(self, x, out=out)


class ReplicatedLinear(LinearBase):
    """All of W on every rank. `output_size` may be a list of part sizes (MoE router + shared-expert gate)."""

    def __init__(self, input_size: int, output_size, bias: bool = False, **kw):
        sizes = list(output_size) if isinstance(output_size, (list, tuple)) else [output_size]
        kw.setdefault("fused_name", None)
        super().__init__(input_size, sizes, bias, **kw)


class ColumnParallelLinear(LinearBase):
    split_output = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, **kw):
        super().__init__(input_size, [output_size], bias, **kw)


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input (gate / up) as one GEMM: W = [W_0; W_1; ...] per rank,
    each part split over ranks on its own."""

    split_output = True

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False, **kw):
        super().__init__(input_size, output_sizes, bias, **kw)


class QKVParallelLinear(LinearBase):
    """q, k and v projections as one GEMM. Heads are split over ranks; when there are fewer kv heads than
    ranks, each kv head is replicated over tp_size / num_kv_heads ranks (vLLM's rule)."""

    split_output = True

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 **kw):
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        super().__init__(hidden_size, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim],
                         bias, **kw)

    def _partition_sizes(self) -> list[int]:
        tp, d = self.tp_size, self.head_dim
        self.num_heads = _divide(self.total_num_heads, tp, f"{self.prefix} query heads")
        if self.total_num_kv_heads >= tp:
            self.num_kv_heads = _divide(self.total_num_kv_heads, tp, f"{self.prefix} kv heads")
        else:
            _divide(tp, self.total_num_kv_heads, f"{self.prefix}: the tensor-parallel size over kv heads")
            self.num_kv_heads = 1
        return [self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d]

    def part_shard_start(self, part: int) -> int:
        d = self.head_dim
        if part == 0:
            return self.tp_rank * self.num_heads * d
        if self.total_num_kv_heads >= self.tp_size:
            return self.tp_rank * self.num_kv_heads * d
        return (self.tp_rank // (self.tp_size // self.total_num_kv_heads)) * d


class RowParallelLinear(LinearBase):
    """W's columns split over ranks: each rank multiplies its slice of the input; the partial sums are
    all-reduced and rank 0 adds the bias. reduce_results=False leaves the partial sums to the caller
    (an MoE block reduces its combined output once instead of once per expert)."""

    split_input = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, *, reduce_results: bool = True, **kw):
        super().__init__(input_size, [output_size], bias, **kw)
        self.reduce_results = reduce_results

    def _reduce(self, y: tallow.Tensor) -> tallow.Tensor:
        return get_tp_group().all_reduce(y) if self.tp_size > 1 and self.reduce_results else y

    def __call__(self, x: tallow.Tensor, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        return self._reduce(self.quant_method.apply(self, x, out=out))

    def apply_gated(self, x: tallow.Tensor, activation: str, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """self(act(x[:, :K]) * x[:, K:]): the gated MLP's down projection with the activation folded in."""
        return self._reduce(self.quant_method.apply_gated(self, x, activation, out=out))


class VocabParallelEmbedding(Module):
    """The token table [vocab, hidden], rows split over ranks in equal (padded) ranges."""

    param_names = ("weight",)

    def __init__(self, num_embeddings: int, embedding_dim: int, *, prefix: str = "model.embed_tokens",
                 dtype=tallow.float32, device: str = "cpu", quant_config: Optional[QuantizationConfig] = None,
                 tp_rank: int = 0, tp_size: int = 1):
        super().__init__(prefix)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self.tp_rank, self.tp_size = int(tp_rank), int(tp_size)
        self.dtype = dtype
        self.num_embeddings_per_partition = -(-self.num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = min(self.num_embeddings, self.vocab_start + self.num_embeddings_per_partition)
        self.weight = None
        self.quant_method = (quant_config or UNQUANTIZED).get_embedding_method(self)
        self.quant_method.create_weights(self, dtype, device)

    def checkpoint_weight_names(self) -> tuple[Optional[str], list[str]]:
        return None, [self.prefix + ".weight"]

    def weight_loader(self, param: str, loaded: tallow.Tensor, shard_id=None) -> None:
        if loaded.ndim != 2 or loaded.shape[0] != self.num_embeddings or loaded.shape[1] != self.embedding_dim:
            raise ValueError(f"{self.prefix}.{param}: shape {list(loaded.shape)}, the config needs "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        n = self.vocab_end - self.vocab_start
        src = loaded.narrow(0, self.vocab_start, n) if self.tp_size > 1 else loaded
        self.quant_method.load(self, param, src, 0)
        self._loaded.add((param, shard_id))

    def dummy_parts(self) -> Iterator[tuple]:
        yield self.weight, self.prefix + ".weight", "embed", self.embedding_dim

    def __call__(self, ids: tallow.Tensor) -> tallow.Tensor:
        if self.tp_size == 1:
            return self.quant_method.apply(self, ids)
        # Each rank looks up the ids in its vocabulary range (ids outside it give zero rows, on the device:
        # no host sync, so the decode graphs capture it), and the all-reduce adds the one non-zero row per token.
        return get_tp_group().all_reduce(self.quant_method.apply(self, ids, vocab_start=self.vocab_start))


class ParallelLMHead(ColumnParallelLinear):
    """logits = hidden @ W^T over the vocabulary (column-parallel: each rank its vocabulary range; the
    logits are all-gathered with tensor parallelism). `tie(embedding)` shares the embedding's table
    (and its storage type: a GGUF block table stays quantized)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, bias: bool = False, *, prefix: str = "lm_head",
                 tied_to: Optional[VocabParallelEmbedding] = None, **kw):
        self.tied = False
        super().__init__(embedding_dim, num_embeddings, bias, prefix=prefix, dummy_names=None,
                         create=tied_to is None, **kw)
        if tied_to is not None:
            self.bias = tallow.empty([self.output_partition_sizes[0]], self.dtype, kw.get("device", "cpu")) \
                if bias else None
            self.tie(tied_to)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        from tallow.layers.quantization.gguf import GGUFLinearMethod
        from tallow.layers.quantization.unquantized import UnquantizedLinearMethod

        if embedding.tp_size != self.tp_size or embedding.num_embeddings_per_partition != \
                self.output_partition_sizes[0]:
            raise ValueError("a tied lm_head needs the embedding's vocabulary partition")
        w = embedding.weight
        self.quant_method = GGUFLinearMethod([w.dtype]) if w.dtype.is_block else UnquantizedLinearMethod()
        self.weight, self.weight_parts = w, None
        self.tied = True
        self._tied_to = embedding

    def __call__(self, x: tallow.Tensor, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """The logits over the whole vocabulary: with tp_size > 1 every rank's vocabulary range,
        all-gathered (every rank gets them; rank 0 samples)."""
        logits = self.local_logits(x, out)
        return get_tp_group().all_gather(logits, dim=-1) if self.tp_size > 1 else logits

    def local_logits(self, x: tallow.Tensor, out: Optional[tallow.Tensor] = None) -> tallow.Tensor:
        """This rank's vocabulary range of the logits (no communication)."""
        return self.quant_method.apply(self, x, out=out)

    def process_weights_after_loading(self) -> None:
        if self.tied:  # the embedding may have taken the checkpoint's tensor itself (a GGUF view on the CPU)
            self.weight = self._tied_to.weight
        super().process_weights_after_loading()

    def dummy_parts(self) -> Iterator[tuple]:
        if not self.tied:
            yield self.weight, self.prefix + ".weight", "embed", self.input_size
        if self.bias is not None:
            yield self.bias, self.prefix + ".bias", "bias", self.input_size
