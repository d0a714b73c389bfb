"""paged_attention and reshape_and_cache against float64 numpy references.

paged_attention's reference gathers each sequence's keys and values out of the paged cache
through its block table and runs the float64 contiguous reference (cases_attention.attention_ref)
with the sequence's new tokens as the last queries. Tolerance: DEFAULT_TOL, for the same reasons as
cases_attention: inputs are rounded to the case's dtype before the reference sees them, the kernel
accumulates in f32 (online softmax: each rescale costs ~1 f32 ulp, ~1e-7 relative, well under
1e-5), and f16/bf16 outputs are rounded once at the end (relative L2 ~3e-4 < 1e-3, ~2.3e-3 < 8e-3).

Caches are filled with random values everywhere (unused blocks and rows too), block ids are a
random permutation of the pool, so reading a wrong block or row shows up as a large error.
reshape_and_cache is a copy with one rounding to the cache's dtype: exact for equal dtypes.
"""
from __future__ import annotations

import numpy as np

from backend_ops import Keep, OpCase, poisoned, register
from backend_ops.cases_attention import attention_ref
import tallow


def make_batch(rng, seqs, hq, hk, d, block_size, dv=None, extra_blocks=3, qmul=1.0, pad=0):
    """Random paged inputs for sequences given as (seq_len, num_new_tokens).

    Returns float64 q [T, Hq, D], k_cache / v_cache [NB, BS, Hk, D|Dv] (random everywhere) and
    int32 block_tables [B, max_blocks] (shuffled block ids; unused entries = pad), seq_lens [B],
    query_start_loc [B + 1].
    """
    dv = d if dv is None else dv
    need = [-(-L // block_size) for L, _ in seqs]
    num_blocks = sum(need) + extra_blocks
    max_blocks = max(need + [1]) + 1  # one spare column: tables are wider than any sequence needs
    perm = rng.permutation(num_blocks)
    tables = np.full((len(seqs), max_blocks), pad, dtype=np.int32)
    at = 0
    for b, nb in enumerate(need):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    n_new = [n for _, n in seqs]
    qsl = np.concatenate([[0], np.cumsum(n_new)]).astype(np.int32)
    return {
        "q": qmul * rng.standard_normal((int(qsl[-1]), hq, d)),
        "k_cache": rng.standard_normal((num_blocks, block_size, hk, d)),
        "v_cache": rng.standard_normal((num_blocks, block_size, hk, dv)),
        "block_tables": tables,
        "seq_lens": np.array([L for L, _ in seqs], dtype=np.int32),
        "query_start_loc": qsl,
    }


def gather_kv(cache, table, seq_len):
    """[seq_len, Hk, D] rows of one sequence out of a paged cache."""
    bs = cache.shape[1]
    pos = np.arange(seq_len)
    return cache[np.asarray(table)[pos // bs], pos % bs]


def paged_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, window=0, softcap=0.0):
    """float64 paged attention: per sequence, contiguous attention of its new tokens over its KV."""
    hq, dv = q.shape[1], v_cache.shape[3]
    out = np.zeros((q.shape[0], hq, dv))
    for b in range(len(seq_lens)):
        q0, q1, L = int(query_start_loc[b]), int(query_start_loc[b + 1]), int(seq_lens[b])
        if q1 == q0:
            continue
        k = gather_kv(k_cache, block_tables[b], L)
        v = gather_kv(v_cache, block_tables[b], L)
        out[q0:q1] = attention_ref(q[q0:q1], k, v, scale, True, window, softcap)
    return out


def scatter_ref(k, v, k_cache, v_cache, slots):
    """float64 reshape_and_cache on copies of the caches."""
    kc, vc = k_cache.copy(), v_cache.copy()
    bs = kc.shape[1]
    for t, s in enumerate(np.asarray(slots)):
        if s >= 0:
            kc[s // bs, s % bs] = k[t]
            vc[s // bs, s % bs] = v[t]
    return kc, vc


_INDEX_KEYS = ("block_tables", "seq_lens", "query_start_loc")


def _paged(name, seqs, hq, hk, d, bs, dv=None, window=0, softcap=0.0, qmul=1.0, q_dtype=None, out=False):
    scale = d**-0.5

    def make(rng, dtype):
        inp = make_batch(rng, seqs, hq, hk, d, bs, dv=dv, qmul=qmul)
        if q_dtype:  # q (and the output) in another dtype than the caches
            inp["q"] = Keep(inp["q"].astype(np.float32), q_dtype)
        return inp

    def run(t, dtype, dev):
        o = poisoned((t["q"].shape[0], hq, d if dv is None else dv), t["q"].dtype, dev) if out else None
        return tallow.ops.paged_attention(t["q"], t["k_cache"], t["v_cache"], t["block_tables"], t["seq_lens"],
                                          t["query_start_loc"], scale, sliding_window=window, softcap=softcap,
                                          out=o)

    def ref(r):
        return paged_ref(r["q"], r["k_cache"], r["v_cache"], *(r[k] for k in _INDEX_KEYS), scale, window, softcap)

    return OpCase(f"paged_attention[{name}]", make, run, ref)


def _cache_write(name, t_len, hk, d, bs, num_blocks, skip=3, cache_dtype=None):
    # Writing into a bf16 cache rounds f32/f16 inputs to bf16 (relative L2 ~2^-8/sqrt(3) over the
    # written rows): the bf16 bound then; same-dtype writes are exact.
    tol = {"float32": 8e-3, "float16": 8e-3, "bfloat16": 0.0} if cache_dtype == "bfloat16" else None

    def make(rng, dtype):
        slots = rng.permutation(num_blocks * bs)[:t_len].astype(np.int64)
        slots[rng.permutation(t_len)[:skip]] = -1  # padding tokens
        inp = {"k": rng.standard_normal((t_len, hk, d)), "v": rng.standard_normal((t_len, hk, d)),
               "k_cache": rng.standard_normal((num_blocks, bs, hk, d)),
               "v_cache": rng.standard_normal((num_blocks, bs, hk, d)), "slots": slots}
        if cache_dtype:
            for key in ("k_cache", "v_cache"):
                inp[key] = Keep(inp[key].astype(np.float32), cache_dtype)
        return inp

    def run(t, dtype, dev):
        tallow.ops.reshape_and_cache(t["k"], t["v"], t["k_cache"], t["v_cache"], t["slots"])
        return t["k_cache"], t["v_cache"]

    def ref(r):
        return scatter_ref(r["k"], r["v"], r["k_cache"], r["v_cache"], r["slots"])

    case = OpCase(f"reshape_and_cache[{name}]", make, run, ref)
    if tol:
        case.tol = tol
    return case


# A batch the scheduler produces: decodes, a fresh prefill, a prefill over a cached prefix, a
# chunk of a chunked prefill, a one-token sequence.
MIXED = [(37, 1), (70, 70), (50, 13), (1, 1), (90, 17), (129, 1)]

register(
    _paged("mixed-gqa8:2-d128-bs16", MIXED, hq=8, hk=2, d=128, bs=16, qmul=2.0, out=True),
    _paged("mixed-mqa-d80-bs32", MIXED, hq=4, hk=1, d=80, bs=32, qmul=2.0),
    _paged("mixed-mha-d64-bs16", MIXED, hq=2, hk=2, d=64, bs=16),
    _paged("window-softcap-bs16", MIXED, hq=8, hk=2, d=64, bs=16, window=21, softcap=5.0, qmul=4.0),
    _paged("decode-long-split", [(1500, 1)], hq=4, hk=1, d=128, bs=32, qmul=2.0),  # few items: split keys
    _paged("decode-batch-d128", [(300 + 7 * b, 1) for b in range(6)], hq=8, hk=2, d=128, bs=16),
    _paged("dv-ne-d", [(40, 9), (23, 1)], hq=4, hk=2, d=80, dv=48, bs=16),
    _paged("q-f32-cache", MIXED[:3], hq=8, hk=2, d=64, bs=16, q_dtype="float32"),
    _cache_write("bs16", t_len=29, hk=2, d=64, bs=16, num_blocks=4),
    _cache_write("bs32-d80-to-bf16", t_len=40, hk=4, d=80, bs=32, num_blocks=3, cache_dtype="bfloat16"),
)
