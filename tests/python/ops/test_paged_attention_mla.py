"""paged_attention in DeepSeek's latent layout (layers/mla.py): one KV head whose key row is [c_kv | k_pe]
(D = 576 at DeepSeek's sizes: 512 latent + 64 rope dims) and whose value is a strided view of the key
cache's first Dv = 512 columns; 16-128 query heads share it (MQA). On every device, against a float64
numpy reference on the same (rounded) inputs, fresh random values: decodes (one query per sequence) and
prefill chunks (several queries, causal). Bound: relative L2 <= 2e-5 in f32 (f32 dot products and
online-softmax accumulation over <= 300 keys), 2e-2 in bf16 (inputs and output rounded to 8 bits)."""
import numpy as np
import pytest

import tallow
from tallow import ops
from engine_models import DEVICES

TOL = {"float32": 2e-5, "bfloat16": 2e-2}


def reference(q, rows, v_dim, lens, qsl, scale):
    """q [T, H, D], rows [B][L_b, D] (the sequence's cache rows in order); causal per sequence."""
    out = np.zeros((q.shape[0], q.shape[1], v_dim))
    for b, (n, L) in enumerate(zip(np.diff(qsl), lens)):
        k = rows[b][:L]
        for i in range(n):
            t = qsl[b] + i
            pos = L - n + i
            s = scale * (q[t] @ k[:pos + 1].T)  # [H, pos + 1]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            out[t] = (p / p.sum(axis=1, keepdims=True)) @ k[:pos + 1, :v_dim]
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("heads,d,dv,queries", [(16, 576, 512, [1, 1, 1]), (128, 576, 512, [1, 1]),
                                                (16, 576, 512, [1, 7, 33]), (8, 48, 32, [3, 1])])
def test_latent_layout_matches_numpy(rng, device, dtype, heads, d, dv, queries):
    bs, lens = 16, [int(x) for x in rng.integers(40, 300, size=len(queries))]
    lens = [max(L, n) for L, n in zip(lens, queries)]
    blocks_per = [-(-L // bs) for L in lens]
    num_blocks = sum(blocks_per) + 3
    perm = rng.permutation(num_blocks)  # sequences' blocks scattered over the pool
    tables, at = np.full((len(lens), max(blocks_per)), -1, dtype=np.int32), 0
    for b, nb in enumerate(blocks_per):
        tables[b, :nb] = perm[at:at + nb]
        at += nb
    cache = rng.standard_normal((num_blocks, bs, 1, d)).astype(np.float32)
    qsl = np.concatenate([[0], np.cumsum(queries)]).astype(np.int32)
    q = rng.standard_normal((int(qsl[-1]), heads, d)).astype(np.float32)

    def put(a):
        t = tallow.tensor(a, dtype=dtype)
        return t if device == "cpu" else t.to(device)

    k_cache = put(cache)
    v_cache = k_cache.narrow(3, 0, dv)  # the latent: a view, no second buffer
    qt = put(q)
    idx = [tallow.from_numpy(a) for a in (tables, np.asarray(lens, dtype=np.int32), qsl)]
    if device != "cpu":
        idx = [t.to(device) for t in idx]
    scale = 1.0 / np.sqrt(192.0)
    got = ops.paged_attention(qt, k_cache, v_cache, *idx, float(scale))
    got = got.to("cpu").to(tallow.float32).numpy().astype(np.float64)
    # the reference on the inputs as the kernel saw them (rounded to dtype)
    c64 = k_cache.to("cpu").to(tallow.float32).numpy().astype(np.float64)
    q64 = qt.to("cpu").to(tallow.float32).numpy().astype(np.float64)
    rows = [c64[tables[b, :nb]].reshape(-1, d) for b, nb in enumerate(blocks_per)]
    ref = reference(q64, rows, dv, lens, qsl, scale)
    assert got.shape == ref.shape
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err < TOL[dtype], err
