"""Embeddings run in chunks of the prefill size (EngineCore.embed_chunk), so one long input delays the
running streams no more than a prompt does: chunked and one-pass results agree, and every KV block
returns to the pool."""
import numpy as np
import pytest

from server_harness import write_tiny_llama
from tallow.engine.args import EngineArgs
from tallow.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=5)


def _engine(model_dir, chunk):
    return LLMEngine(EngineArgs(model=str(model_dir), num_kv_blocks=32, max_model_len=128, prefill_chunk_size=chunk))


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_chunked_embeddings_match_one_pass(model_dir, pooling):
    rng = np.random.default_rng(3)
    inputs = [rng.integers(2, 300, size=n).tolist() for n in (37, 5, 64)]
    whole = _engine(model_dir, 0)  # chunk = the whole token budget: one pass per input
    chunked = _engine(model_dir, 8)
    assert chunked.embed_chunk_tokens == 8 and whole.embed_chunk_tokens >= 64
    for normalize in (True, False):
        a = whole.embed([{"prompt_token_ids": x} for x in inputs], pooling=pooling, normalize=normalize)
        b = chunked.embed([{"prompt_token_ids": x} for x in inputs], pooling=pooling, normalize=normalize)
        for (va, na), (vb, nb), x in zip(a, b, inputs):
            assert na == nb == len(x)
            assert va.dtype == np.float32 and va.shape == (64,)
            assert np.abs(va).max() > 1e-3
            # f32 attention over the same keys in a different split: a few ulps apart
            np.testing.assert_allclose(vb, va, rtol=2e-5, atol=2e-6)
            if normalize:
                assert abs(float(np.linalg.norm(va)) - 1.0) < 1e-5
    for eng in (whole, chunked):
        assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks


def test_embed_job_releases_blocks_when_abandoned(model_dir):
    from tallow.engine.core import EmbedJob

    eng = _engine(model_dir, 8)
    job = EmbedJob("k", [list(range(2, 42))], "mean", True)
    assert not eng.embed_chunk(job, 8)  # one chunk of five done; the input holds its blocks
    assert eng.kv.pool.num_free_blocks < eng.kv.pool.num_blocks
    eng.release_embed(job)  # an abort
    assert eng.kv.pool.num_free_blocks == eng.kv.pool.num_blocks
