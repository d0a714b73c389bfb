"""Mixed steps (decodes, then prefill chunks) run attention as two calls: the decode sequences
through one paged_attention call (the split-KV decode kernel on CUDA) and the prefill chunks
through another, with their query starts rebased to 0 (layers/attention.py, worker/step_inputs.py).

Checked: the split gives the same result as one call over the whole batch (bitwise on the CPU,
where each sequence's result does not depend on its batch; within the bf16 bound of
test_paged_attention.py against the float64 reference on CUDA), StepInputs builds the rebased
query starts, and the runner marks the decode prefix of each step."""
import numpy as np
import pytest

import tallow
import tallow.cuda as tc
from backend_ops import relative_error
from backend_ops.cases_paged_attention import make_batch, paged_ref
from tallow.worker.step_inputs import StepInputs
from tallow.layers.attention import AttentionMetadata, PagedAttention

# (seq_len, new tokens): four decodes (one of a 1-token sequence), then prefill chunks (one over a
# cached prefix), then a sequence whose one new token is its prompt's last (a prefill after the
# prefix: the split keeps it with the prefills).
SEQS = [(45, 1), (300, 1), (1, 1), (97, 1), (64, 64), (130, 33), (77, 20), (12, 1)]
NUM_DECODES = 4
HQ, HK, D, BS = 8, 2, 64, 16


def metadata(inp, device, num_decodes):
    def t(a):
        x = tallow.from_numpy(np.ascontiguousarray(a.astype(np.int32)))
        return x if device == "cpu" else x.to(device)

    qsl = inp["query_start_loc"]
    slots = tallow.from_numpy(np.zeros(int(qsl[-1]), np.int64))
    return AttentionMetadata(
        slot_mapping=slots if device == "cpu" else slots.to(device),
        block_tables=t(inp["block_tables"]), seq_lens=t(inp["seq_lens"]), query_start_loc=t(qsl),
        num_tokens=int(qsl[-1]), num_decode_seqs=num_decodes,
        prefill_query_start_loc=t(qsl[num_decodes:] - qsl[num_decodes]) if num_decodes else None)


def run(inp, dtype, device, num_decodes, **layer_kw):
    attn = PagedAttention(HQ, HK, D, D ** -0.5, **layer_kw)
    q, kc, vc = (tallow.tensor(inp[k].astype(np.float32), dtype=dtype) for k in ("q", "k_cache", "v_cache"))
    if device != "cpu":
        q, kc, vc = q.to(device), kc.to(device), vc.to(device)
    out = attn.attend(q, (kc, vc), metadata(inp, device, num_decodes))
    return out.to("cpu").to("float32").numpy().astype(np.float64)


@pytest.mark.parametrize("layer_kw", [{}, {"sliding_window": 40}, {"softcap": 5.0}], ids=["plain", "window", "softcap"])
def test_split_equals_one_call_cpu(layer_kw):
    inp = make_batch(np.random.default_rng(11), SEQS, HQ, HK, D, BS)
    whole = run(inp, "float32", "cpu", 0, **layer_kw)
    split = run(inp, "float32", "cpu", NUM_DECODES, **layer_kw)
    assert np.array_equal(whole, split)
    ref = paged_ref(*(inp[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")),
                    D ** -0.5, layer_kw.get("sliding_window", 0), layer_kw.get("softcap", 0.0))
    assert relative_error(split, ref) < 1e-5


@pytest.mark.skipif(not tc.is_available(), reason="needs a CUDA device (tallow built with CUDA)")
def test_split_on_cuda_bf16():
    inp = make_batch(np.random.default_rng(12), SEQS, HQ, HK, D, BS)
    rounded = {k: tallow.tensor(v.astype(np.float32), dtype="bfloat16").to("float32").numpy().astype(np.float64)
               if k in ("q", "k_cache", "v_cache") else v for k, v in inp.items()}
    ref = paged_ref(*(rounded[k] for k in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc")),
                    D ** -0.5)
    split = run(inp, "bfloat16", "cuda", NUM_DECODES)
    whole = run(inp, "bfloat16", "cuda", 0)
    assert relative_error(split, ref) < 8e-3
    assert relative_error(whole, ref) < 8e-3
    # the decode rows differ between the kernels by bf16 rounding; the prefill rows run the same kernel
    t = NUM_DECODES
    assert relative_error(split[t:], whole[t:]) < 1e-3


def test_step_inputs_rebase_the_prefill_query_starts():
    inp = StepInputs(max_tokens=64, max_seqs=6, max_blocks_per_seq=4, device="cpu")
    lens = [1, 1, 1, 9, 5]
    inp.qsl[:6] = np.concatenate([[0], np.cumsum(lens)])
    inp.set_decode_prefix(3, 5)
    _, _, meta, _ = inp.views(17, 5, 0, 3)
    assert meta.num_decode_seqs == 3
    assert meta.prefill_query_start_loc.numpy().tolist() == [0, 9, 14]
    _, _, meta, _ = inp.views(17, 5, 0, 0)  # no decode prefix: one call
    assert meta.num_decode_seqs == 0 and meta.prefill_query_start_loc is None
    _, _, meta, _ = inp.views(3, 3, 0, 3)  # decodes only: one call (the decode kernel)
    assert meta.num_decode_seqs == 0 and meta.prefill_query_start_loc is None
