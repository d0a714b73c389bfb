"""ops.embedding with vocab_start: a vocabulary-parallel rank's slice of the token table. Id i selects row
i - vocab_start; ids outside the slice give zero rows (no IndexError: every rank sees every id). Against
numpy on fresh random tables (float32, bfloat16, and a GGUF Q4_K table compared with its dequantized
rows), on every device; the halves of two slices add up to the whole table's lookup exactly (at most one
non-zero row per id), which is what the vocabulary-parallel embedding's all-reduce relies on."""
import numpy as np
import pytest

import tallow
from tallow import ops
from engine_models import DEVICES


def _on(t, device):
    return t if device == "cpu" else t.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "q4_k"])
def test_slices_add_up_to_the_whole_table(rng, device, dtype):
    V, D = 96, 256  # D: a multiple of Q4_K's 256-value blocks
    full = rng.standard_normal((V, D)).astype(np.float32)
    if dtype == "q4_k":
        table = tallow._core.quantize(tallow.tensor(full), "q4_k")
        rows = tallow._core.dequantize(table).numpy()
    else:
        table = tallow.tensor(full, dtype=dtype)
        rows = table.to(tallow.float32).numpy()
    ids = rng.integers(0, V, size=(3, 7)).astype(np.int64)
    ids[0, 0], ids[2, 6] = 0, V - 1
    whole = _on(tallow.tensor(ids), device)
    half = V // 2
    parts = []
    for start, stop in ((0, half), (half, V)):
        sl = _on(table.narrow(0, start, stop - start).contiguous(), device)
        got = ops.embedding(whole, sl, "float32", vocab_start=start).to("cpu").numpy()
        inside = (ids >= start) & (ids < stop)
        want = np.where(inside[..., None], rows[np.clip(ids, start, stop - 1)], 0.0)
        np.testing.assert_array_equal(got, want)
        parts.append(got)
    np.testing.assert_array_equal(parts[0] + parts[1], rows[ids])
    # int32 ids and ids far outside (negative, past the vocabulary) are zero rows, not errors
    odd = np.array([-5, 3, V + 10, half + 1], dtype=np.int32)
    sl = _on(table.narrow(0, half, V - half).contiguous(), device)
    got = ops.embedding(_on(tallow.tensor(odd), device), sl, "float32", vocab_start=half).to("cpu").numpy()
    np.testing.assert_array_equal(got[[0, 1, 2]], 0.0)
    np.testing.assert_array_equal(got[3], rows[half + 1])
    # without vocab_start an out-of-range id still raises
    with pytest.raises(IndexError, match="out of range"):
        ops.embedding(_on(tallow.tensor(odd), device), sl, "float32")
