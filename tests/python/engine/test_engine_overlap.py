"""Overlapped (asynchronous) scheduling: step n is launched before step n-1's tokens are read back,
with the unknown tokens filled in on the device. It is the default on a GPU; here it runs on the CPU
(async_scheduling=True, device-side sampling ops) so CI covers the bookkeeping: the same tokens as the
synchronous engine under greedy decoding, stop strings/ids, max_tokens, min_tokens, n > 1, aborts,
prefix caching, preemption and penalties, and every KV block back in the pool afterwards; with one,
two and three launched steps left unread (TALLOW_OVERLAP_DEPTH) against the CPU default (none left
unread: each step is read back as soon as it is launched)."""
import numpy as np
import pytest

pytest.importorskip("torch", reason="transformers (with CPU torch) makes the random checkpoint")
pytest.importorskip("transformers", reason="transformers makes the random checkpoint")

from engine_models import make_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402


@pytest.fixture(autouse=True, params=["1", "2", "3"], ids=["depth1", "depth2", "depth3"])
def overlap_depth(request, monkeypatch):
    """Launched steps left unread between steps (TALLOW_OVERLAP_DEPTH; the GPU default is 2)."""
    monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", request.param)
    return int(request.param)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_overlap")
    make_llama(path, seed=3)
    return path


def prompts(n, seed=0, lo=2, hi=60):
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(2, 320, int(rng.integers(lo, hi))).tolist()} for _ in range(n)]


def assert_pool_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not llm.engine._pending


def run(model_dir, reqs, params, **kw):
    llm = LLM(str(model_dir), dtype="float32", **kw)
    outs = llm.generate(reqs, params)
    assert_pool_free(llm)
    return llm, [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outs]


@pytest.mark.parametrize("extra", [dict(), dict(num_kv_blocks=24, max_num_seqs=8), dict(prefill_chunk_size=16,
                                                                                        max_num_batched_tokens=32),
                                   dict(prefill_chunk_size=8, max_num_batched_tokens=8)],
                         ids=["plain", "preempting", "chunked", "decodes-left-out"])
def test_overlap_equals_sync_greedy(model_dir, extra):
    reqs = prompts(12)
    params = [SamplingParams(temperature=0, max_tokens=int(m), ignore_eos=True) for m in np.arange(12) * 3 + 1]
    llm, sync = run(model_dir, reqs, params, async_scheduling=False, **extra)
    assert llm.engine.overlap is False
    llm, over = run(model_dir, reqs, params, async_scheduling=True, **extra)
    assert llm.engine.overlap is True
    assert over == sync
    assert all(len(o[0][0]) == p.max_tokens for o, p in zip(over, params))


def test_overlap_stops_min_tokens_and_eos(model_dir):
    reqs = prompts(10, seed=1)
    # EOS is token 1 ("t1"); stop ids / strings picked from a first greedy run so they really occur.
    _, base = run(model_dir, reqs, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                  async_scheduling=False)
    params = []
    for i, b in enumerate(base):
        toks = b[0][0]
        if i % 3 == 0:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[toks[5]], ignore_eos=True))
        elif i % 3 == 1:
            params.append(SamplingParams(temperature=0, max_tokens=30, stop=[f"t{toks[4]}"], ignore_eos=True))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=30, min_tokens=8, stop_token_ids=[toks[2]],
                                         ignore_eos=True))
    _, sync = run(model_dir, reqs, params, async_scheduling=False)
    _, over = run(model_dir, reqs, params, async_scheduling=True)
    assert over == sync
    assert any(o[0][2] == "stop" for o in over)


def test_overlap_n2_prefix_cache_and_penalties(model_dir):
    shared = prompts(1, seed=5, lo=40, hi=41)[0]["prompt_token_ids"]
    reqs = [{"prompt_token_ids": shared + [7 + i]} for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2 if i % 2 else 1,
                             repetition_penalty=1.3 if i == 2 else 1.0, frequency_penalty=0.5 if i == 3 else 0.0)
              for i in range(6)]
    _, sync = run(model_dir, reqs, params, async_scheduling=False)
    llm, over = run(model_dir, reqs, params, async_scheduling=True)
    assert over == sync
    assert llm.engine.kv.prefix_cache_hit_rate > 0


def test_overlap_abort_midway_frees_everything(model_dir):
    llm = LLM(str(model_dir), dtype="float32", async_scheduling=True)
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)) for p in prompts(8, 2)]
    done = {}
    for step in range(200):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if step == 6:
            for rid in ids[::2]:
                eng.abort_request(rid)
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert set(done) <= set(ids[1::2]) and len(done) == 4
    # Flush a pending step, if any, then the pool must be whole.
    while eng._pending or eng.scheduler.has_unfinished:
        eng.step()
    assert_pool_free(llm)


def test_overlap_request_left_out_of_a_step(model_dir):
    """A live request that a step leaves out (as a token budget or a preemption may) while older steps
    are unread: its newest token belongs to an older step than the device holds for the next one, so
    the engine reads that step first (the same tokens as the synchronous engine)."""
    def go(async_scheduling):
        llm = LLM(str(model_dir), dtype="float32", async_scheduling=async_scheduling)
        sched = llm.engine.scheduler
        schedule, calls = sched.schedule, [0]

        def leaving_one_out():
            calls[0] += 1
            held = sched.running[:1] if calls[0] in (6, 7, 11) else []
            for r in held:
                sched.running.remove(r)
            try:
                return schedule()
            finally:
                sched.running[:0] = held

        sched.schedule = leaving_one_out
        outs = llm.generate(prompts(4, seed=7), SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        assert_pool_free(llm)
        return [o.outputs[0].token_ids for o in outs]

    assert go(True) == go(False)
