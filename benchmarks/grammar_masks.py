"""Host cost of structured output per decode step: GrammarSet.bitmask (llguidance's parallel executor)
and GrammarSet.consume for --batch matchers of one JSON schema, walked with random allowed tokens,
at several executor thread counts. Tells whether the masks of a batch fit inside a step's forward pass.

    python benchmarks/grammar_masks.py [--vocab 512|128256] [--batch 64] [--threads 1,2,4,8,12]

--vocab 512: stories260K's SentencePiece vocabulary (TALLOW_TEST_DATA); 128256: benchmarks/gpu_e2e.py's
byte-level tokenizer of Llama 3's width.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [_HERE]


def tokenizer(vocab: int):
    from tallow.tokenizer import load_tokenizer

    if vocab == 512:
        data = os.environ.get("TALLOW_TEST_DATA", os.path.join(_HERE, "..", "..", "shared", "data"))
        return load_tokenizer(os.path.join(data, "stories260K", "stories260K.gguf")), [2]
    import gpu_e2e

    d = tempfile.mkdtemp()
    gpu_e2e.write_byte_level_tokenizer(d, vocab, vocab - 255)
    return load_tokenizer(d), [vocab - 255]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128256, choices=[512, 128256])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", default="1,2,4,8,12")
    a = ap.parse_args()

    import llguidance as llg

    from structured_output import LONG_SCHEMA
    from tallow.engine.structured_output import GrammarSet, StructuredOutputsParams

    tok, eos = tokenizer(a.vocab)
    gs = GrammarSet(tok, a.vocab, eos)
    template = gs.compile(StructuredOutputsParams(json=LONG_SCHEMA)).result()
    ids = [f"r{i}" for i in range(a.batch)]
    print(f"vocab {a.vocab}, batch {a.batch}, {os.cpu_count()} CPUs")
    for nt in [int(x) for x in a.threads.split(",")]:
        for r in ids:
            gs.add(r, template.deep_copy())
        gs._executor = llg.LLExecutor(num_threads=nt)
        rng = np.random.default_rng(0)
        gs.mask_s = gs.consume_s = 0.0
        for _ in range(a.steps):
            mask = gs.bitmask(ids)
            bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :a.vocab]
            for r, row in zip(ids, bits):
                allowed = np.flatnonzero(row)
                assert gs.consume(r, int(rng.choice(allowed))) is None
        print(f"  threads {nt:3d}: masks {1e3 * gs.mask_s / a.steps:6.2f} ms/step, "
              f"consume {1e3 * gs.consume_s / a.steps:6.2f} ms/step")


if __name__ == "__main__":
    main()
