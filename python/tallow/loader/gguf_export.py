"""`tallow quantize SRC OUT.gguf --type q4k`: a checkpoint (a safetensors folder, a config-only folder
with load_format="dummy", or a GGUF: float tensors quantized, block tensors dequantized and quantized
again unless already of the chosen type) written as a quantized GGUF that llama.cpp and tallow load.

The model is built exactly as `--isq` builds it (models.load_model with layers/quantization/isq.py's
config, quantizing on `device` one tensor at a time), then its parameters are written with gguf-py's
GGUFWriter under llama.cpp's names: so `--isq T` and this file hold the same blocks, bit for bit.
What is written (what llama.cpp's convert_hf_to_gguf.py writes for these families):
- general.architecture / name / file_type / quantization_version, the hparams llama.cpp reads
  (the inverse of tallow.config's GGUF reading);
- the tensors under the family's GGUF names, llama-architecture q/k rows permuted to GGUF's interleaved
  RoPE layout (LlamaModel.permute; the reader un-permutes them); norms and biases F32;
- the tokenizer: tokenizer.json BPE -> tokenizer.ggml.model "gpt2" (tokens, token_type, merges,
  tokenizer.ggml.pre found from the pre-tokenizer's regex), tokenizer.model SentencePiece -> "llama"
  (tokens, scores, token_type); bos/eos/unk/pad ids, add_bos, chat_template. A folder without a tokenizer
  (benchmarks) gets tokenizer.ggml.model "none" and {arch}.vocab_size.
Families: llama (and mistral, written as llama), qwen2, qwen3; others are a clear error.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Callable, Optional

import numpy as np

log = logging.getLogger("tallow.quantize")

EXPORT_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class ExportError(ValueError):
    """A checkpoint `tallow quantize` cannot write; the message names the file and the problem."""


@dataclasses.dataclass
class ExportResult:
    path: str
    nbytes: int
    type_counts: dict  # {GGUF type name: tensors}
    tensor_types: dict  # {GGUF tensor name: GGUF type name}


def _gguf():
    try:
        import gguf
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise ExportError("tallow quantize needs the gguf package (pip install gguf)") from None
    return gguf


# -- names ----------------------------------------------------------------------------------------
def _arch_and_family(cfg) -> tuple[str, type]:
    from tallow.models import registry

    if cfg.family not in EXPORT_FAMILIES:
        raise ExportError(f"tallow quantize: writing the {cfg.family!r} family ({cfg.architecture}) as GGUF is not "
                          f"supported; supported: {', '.join(EXPORT_FAMILIES)}")
    cls = registry.model_class(cfg.family)
    arch = cls.gguf_written_as or cls.gguf_architectures[0]
    return arch, registry.family_for_gguf(arch)


def _name_map(gguf_family, arch: str) -> Callable[[str], Optional[str]]:
    """Hugging Face weight name -> GGUF tensor name (the inverse of loader/gguf_weights.hf_name)."""
    from tallow.loader.gguf_weights import GLOBAL_MAP

    layer = {hf: g for g, hf in gguf_family.gguf_tensor_names[arch].items() if "{" not in hf}
    glob = {hf: g for g, hf in GLOBAL_MAP.items()}

    def to_gguf(name: str) -> Optional[str]:
        base, _, kind = name.rpartition(".")
        if base in glob:
            return f"{glob[base]}.{kind}"
        parts = base.split(".", 3)
        if len(parts) == 4 and parts[0] == "model" and parts[1] == "layers" and parts[3] in layer:
            return f"blk.{parts[2]}.{layer[parts[3]]}.{kind}"
        return None

    return to_gguf


def _model_tensors(model):
    """(Hugging Face name, tensor) of every parameter, fused layers split into their checkpoint parts."""
    from tallow.layers.linear import LinearBase
    from tallow.layers.module import modules

    for m in modules(model):
        if isinstance(m, LinearBase):
            if getattr(m, "tied", False):
                continue
            for i, part in enumerate(m.part_names):
                if m.weight_parts is not None:
                    w = m.weight_parts[i]
                else:
                    w = m.weight.narrow(0, m.part_offset(i), m.output_partition_sizes[i])
                yield part + ".weight", w
                if m.bias is not None:
                    yield part + ".bias", m.bias.narrow(0, m.part_offset(i), m.output_partition_sizes[i])
            continue
        for name, (param, shard) in m.checkpoint_map().items():
            t = getattr(m, param)
            if shard is not None:
                raise ExportError(f"tallow quantize: {name}: a sharded parameter this writer does not know")
            yield name, t


def _host_array(t):
    """(numpy array, GGML type) of a tallow tensor: block tensors as their bytes [rows, bytes per row],
    float tensors as float32 (float16 for a float16 fallback)."""
    gguf = _gguf()
    import tallow

    t = t if t.device == "cpu" else t.to("cpu")
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dtype.is_block:
        return np.array(t.numpy(raw=True)), gguf.GGMLQuantizationType[t.dtype.name.upper()]
    if t.dtype == tallow.float16:
        return np.array(t.numpy()), gguf.GGMLQuantizationType.F16
    return np.array((t if t.dtype == tallow.float32 else t.to(tallow.float32)).numpy()), gguf.GGMLQuantizationType.F32


# -- metadata -------------------------------------------------------------------------------------
def _write_hparams(w, cfg, arch: str, name: str, file_type: int) -> None:
    gguf = _gguf()
    w.add_name(name)
    w.add_file_type(file_type)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    if cfg.head_dim != cfg.hidden_size // cfg.num_attention_heads:
        w.add_key_length(cfg.head_dim)
        w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.rotary_dim)
    w.add_layer_norm_rms_eps(cfg.norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rope = cfg.rope
    w.add_rope_freq_base(rope.theta)
    if rope.type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope.factor)
    elif rope.type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope.factor)
        w.add_rope_scaling_orig_ctx_len(rope.original_max_position_embeddings)
    elif rope.type not in ("default", "llama3"):
        raise ExportError(f"tallow quantize: RoPE scaling {rope.type!r} is not written to GGUF yet")
    if cfg.sliding_window and all(t != "full_attention" for t in cfg.layer_types):
        w.add_sliding_window(cfg.sliding_window)


def _llama3_rope_freqs(cfg) -> Optional[np.ndarray]:
    """convert_hf_to_gguf's rope_freqs tensor (llama3 RoPE: the per-frequency divisors)."""
    import math

    rope = cfg.rope
    if rope.type != "llama3":
        return None
    if rope.freq_factors is not None:
        return np.asarray(rope.freq_factors, np.float32)
    base, dim = rope.theta, cfg.rotary_dim
    factor = rope.factor or 8.0
    low, high = rope.low_freq_factor or 1.0, rope.high_freq_factor or 4.0
    old = rope.original_max_position_embeddings or 8192
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wl, high_wl = old / low, old / high
    out = []
    for f in freqs:
        wl = 2 * math.pi / f
        if wl < high_wl:
            out.append(1.0)
        elif wl > low_wl:
            out.append(factor)
        else:
            smooth = (old / wl - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


# tokenizer.ggml.pre names by the byte-level pre-tokenizer patterns (tokenizer/gguf_vocab.py's table)
def _pre_name(tok_json: dict, family: str) -> str:
    from tallow.tokenizer import gguf_vocab

    pats: list[str] = []

    def walk(p):
        if not p:
            return
        t = p.get("type")
        if t == "Sequence":
            for q in p.get("pretokenizers", []):
                walk(q)
        elif t == "Split":
            pat = p.get("pattern", {})
            pats.append(pat.get("Regex") or pat.get("String") or "")
        elif t == "Digits" and p.get("individual_digits"):
            pats.append(r"\p{N}")
        elif t == "ByteLevel" and p.get("use_regex", True):
            pats.append(gguf_vocab._GPT2)

    walk(tok_json.get("pre_tokenizer"))
    nfc = "NFC" in json.dumps(tok_json.get("normalizer") or {})
    for name, pre in gguf_vocab._PRE.items():
        if list(pre.regexes) == pats and pre.nfc == nfc and not pre.ignore_merges:
            return name
    fallback = {"llama": "llama-bpe", "mistral": "llama-bpe", "qwen2": "qwen2", "qwen3": "qwen2"}.get(family, "default")
    log.warning("tokenizer pre-tokenizer not recognised; writing tokenizer.ggml.pre=%s", fallback)
    return fallback


def _write_tokenizer(w, source, cfg, family: str) -> None:
    from tallow.tokenizer.gguf_vocab import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED, USER_DEFINED

    src_gguf = source.gguf if source.kind == "gguf" else None
    if src_gguf is not None:  # re-typing a GGUF: its tokenizer keys as they are
        for key, value in src_gguf.metadata.items():
            if key.startswith("tokenizer."):
                _add_raw(w, key, value)
        return
    n = cfg.vocab_size
    tok_cfg = _read_json(source.tokenizer_config_path) or {}
    tok_path = source.tokenizer_path
    tj = _read_json(tok_path) if tok_path else None
    spm_path = source.tokenizer_model_path
    added = {}
    if tj is not None and (tj.get("model") or {}).get("type") == "BPE":
        model = tj["model"]
        vocab = model["vocab"]
        for at in tj.get("added_tokens") or []:
            added[at["id"]] = at
        tokens = [f"[PAD{i}]" for i in range(n)]
        types = [UNUSED] * n
        for piece, i in vocab.items():
            if i < n:
                tokens[i], types[i] = piece, NORMAL
        for i, at in added.items():
            if i < n:
                tokens[i] = at["content"]
                types[i] = CONTROL if at.get("special") else USER_DEFINED
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(_pre_name(tj, family))
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(merges)
    elif spm_path is not None:
        from tallow.tokenizer.sentencepiece_model import load_model

        sp = load_model(spm_path)
        tokens = [f"[PAD{i}]" for i in range(n)]
        scores = [-1000.0] * n
        types = [UNUSED] * n
        kinds = {1: NORMAL, 2: UNKNOWN, 3: CONTROL, 4: USER_DEFINED, 5: UNUSED, 6: BYTE}
        for i, (piece, score, kind) in enumerate(zip(sp.pieces, sp.scores, sp.types)):
            if i < n:
                tokens[i], scores[i], types[i] = piece, float(score), kinds.get(int(kind), NORMAL)
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
    else:
        log.warning("%s: no tokenizer.json (BPE) or tokenizer.model: the GGUF gets no vocabulary "
                    "(tokenizer.ggml.model none)", source.path)
        w.add_tokenizer_model("none")
        return

    def token_id(key):
        v = tok_cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        if not isinstance(v, str):
            return None
        for i, t in enumerate(tokens):
            if t == v:
                return i
        return None

    bos = token_id("bos_token")
    bos = bos if bos is not None else cfg.bos_token_id
    eos = token_id("eos_token")
    eos = eos if eos is not None else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    for key, add in (("unk_token", w.add_unk_token_id), ("pad_token", w.add_pad_token_id)):
        i = token_id(key)
        if i is not None:
            add(i)
    if isinstance(tok_cfg.get("add_bos_token"), bool):
        w.add_add_bos_token(tok_cfg["add_bos_token"])
    elif spm_path is not None and tj is None:
        w.add_add_bos_token(True)
    if isinstance(tok_cfg.get("add_eos_token"), bool):
        w.add_add_eos_token(tok_cfg["add_eos_token"])
    template = tok_cfg.get("chat_template")
    tpl_file = source.chat_template_path
    if template is None and tpl_file:
        with open(tpl_file, encoding="utf-8") as fh:
            template = fh.read()
    if isinstance(template, str):
        w.add_chat_template(template)


def _add_raw(w, key: str, value) -> None:
    """Copy one metadata value read by tallow's GGUF reader into the writer."""
    gguf = _gguf()
    if isinstance(value, (np.ndarray, np.generic)):
        value = value.tolist()
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value) if 0 <= value < 2**32 else w.add_int64(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        w.add_key_value(key, value, gguf.GGUFValueType.STRING)


def _read_json(path) -> Optional[dict]:
    if not path or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


# -- the whole export -------------------------------------------------------------------------------
def export_gguf(src: str, out: str, type_name: str, *, device: str = "cpu", load_format: str = "auto",
                seed: int = 0, name: Optional[str] = None) -> ExportResult:
    """Quantize the checkpoint at `src` to `type_name` (see isq.export_scheme) on `device` and write
    `out`. Raises ExportError / ValueError with one clear line for bad input."""
    import tallow
    from tallow.config import ModelConfig
    from tallow.layers.quantization.isq import ISQConfig, export_scheme
    from tallow.loader.gguf_weights import permute_rows
    from tallow.loader.source import resolve_model_source
    from tallow.models import load_model

    gguf = _gguf()
    scheme = export_scheme(type_name)
    if not os.path.exists(src):
        raise ExportError(f"tallow quantize: {src}: no such file or directory")
    dummy = load_format == "dummy"
    source = resolve_model_source(w=src, config_only=dummy)
    if source.kind == "gguf":
        cfg = ModelConfig.from_gguf(source.gguf)
    else:
        cfg = ModelConfig.from_pretrained_dir(source.model_dir)
    arch, gguf_family = _arch_and_family(cfg)
    qc = ISQConfig(scheme, cfg)
    model = load_model(cfg, source, tallow.float32, device, load_format=load_format, seed=seed, max_positions=16,
                       quant_config=qc)
    to_gguf = _name_map(gguf_family, arch)
    permute = gguf_family.gguf_permuted_qk

    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise ExportError(f"tallow quantize: {out}: the folder {out_dir} does not exist")
    w = gguf.GGUFWriter(out, arch)
    model_name = name or (cfg.raw.get("general.name") if source.kind == "gguf" else None) or \
        os.path.basename(os.path.normpath(source.model_dir if source.kind == "safetensors" else source.path))
    _write_hparams(w, cfg, arch, str(model_name), scheme.file_type)
    _write_tokenizer(w, source, cfg, cfg.family)

    types: dict[str, str] = {}
    freqs = _llama3_rope_freqs(cfg)
    if freqs is not None:
        w.add_tensor("rope_freqs.weight", freqs)
        types["rope_freqs.weight"] = "F32"
    for hf, t in _model_tensors(model):
        gname = to_gguf(hf)
        if gname is None:
            raise ExportError(f"tallow quantize: no GGUF name for {hf!r} in the {arch} architecture")
        arr, qtype = _host_array(t)
        if qc.chosen.get(hf) == "float16" and qtype == gguf.GGMLQuantizationType.F32:
            arr, qtype = arr.astype(np.float16), gguf.GGMLQuantizationType.F16  # exact: rounded at load
        kind = gname.split(".")[-2] if gname.startswith("blk.") else ""
        if permute and kind in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
            arr = permute_rows(arr if arr.ndim == 2 else arr.reshape(arr.shape[0], 1), heads).reshape(arr.shape)
        if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(gname, arr)
        else:
            w.add_tensor(gname, arr, raw_dtype=qtype)  # [rows, bytes]: gguf-py derives the shape
        types[gname] = qtype.name
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=True)
    w.close()
    counts: dict[str, int] = {}
    for v in types.values():
        counts[v] = counts.get(v, 0) + 1
    return ExportResult(out, os.path.getsize(out), counts, types)
