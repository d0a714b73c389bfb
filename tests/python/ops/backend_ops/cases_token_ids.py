"""fill_from_previous_: rows holding -(j + 1) take previous[j], the others keep their id (exact)."""
import numpy as np

from backend_ops import Keep, OpCase, register
import tallow


def _fill(name, t, n, frac):
    def make(rng, dtype):
        ids = rng.integers(0, 50000, t).astype(np.int32)
        refs = rng.random(t) < frac
        ids[refs] = -(rng.integers(0, n, int(refs.sum())) + 1)
        return {"ids": Keep(ids), "previous": Keep(rng.integers(0, 50000, n).astype(np.int32))}

    def run(x, dtype, dev):
        ids = x["ids"].clone()
        tallow.ops.fill_from_previous_(ids, x["previous"])
        return ids

    def ref(r):
        ids, prev = r["ids"].copy(), r["previous"]
        neg = ids < 0
        ids[neg] = prev[-ids[neg] - 1]
        return ids

    return OpCase(f"fill_from_previous_[{name}]", make, run, ref, dtypes=("int32",), exact=True)


register(
    _fill("decode", 64, 64, 1.0),
    _fill("mixed", 1000, 37, 0.1),
    _fill("none", 17, 5, 0.0),
)
