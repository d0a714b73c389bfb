"""AsyncEngine: the step loop in its own thread behind asyncio streams, on a tiny random Llama."""
import asyncio
import threading
import time

import numpy as np
import pytest

from server_harness import collect, write_tiny_llama
from tallow import LLM, SamplingParams
from tallow.engine.args import EngineArgs
from tallow.engine.async_engine import AsyncEngine, EngineDeadError, EngineStepError
from tallow.engine.engine import LLMEngine


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def make_engine(model_dir, **kw) -> LLMEngine:
    kw.setdefault("num_kv_blocks", 128)
    return LLMEngine(EngineArgs(model=str(model_dir), **kw))


def pool_free(eng: LLMEngine) -> bool:
    return (eng.kv.num_free_blocks == eng.kv.pool.num_blocks and all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
            and not eng.has_unfinished_requests())


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# overlap: steps overlapped with the host (the GPU default), run here on the CPU with the device sampling ops.
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_streams_match_offline_generate(model_dir, rng, overlap):
    prompts = [rng.integers(2, 320, int(n)).tolist() for n in rng.integers(3, 40, 6)]
    offline = LLM(str(model_dir), num_kv_blocks=128).generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    eng = make_engine(model_dir, async_scheduling=overlap)

    async def main():
        ae = AsyncEngine(eng)
        streams = [await ae.add_request({"prompt_token_ids": p}, GREEDY, f"r{i}") for i, p in enumerate(prompts)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        await ae.shutdown()
        return results

    for (text, ids, finish), ref in zip(run(main()), offline):
        assert ids[0] == ref.outputs[0].token_ids
        assert text[0] == ref.outputs[0].text
        assert finish[0] == "length"
    assert pool_free(eng)


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_sixteen_concurrent_requests_with_n_and_stop(model_dir, overlap):
    eng = make_engine(model_dir, num_kv_blocks=40, async_scheduling=overlap)  # small: forces preemption under load

    async def main():
        ae = AsyncEngine(eng)
        params = [SamplingParams(temperature=0.8, seed=i, max_tokens=20, n=1 + i % 3, stop=["t7"]) for i in range(16)]
        streams = [await ae.add_request(f"t{i + 10} t{i + 11} t{i + 12}", p) for i, p in enumerate(params)]
        results = await asyncio.gather(*(collect(s) for s in streams))
        free = await ae.run_in_engine(pool_free)
        await ae.shutdown()
        return params, results, free

    params, results, free = run(main())
    assert free
    for p, (text, ids, finish) in zip(params, results):
        assert len(finish) == p.n and set(finish.values()) <= {"stop", "length"}
        for i in range(p.n):
            assert "t7" not in text[i].split()
            assert 1 <= len(ids[i]) <= 20


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_abort_frees_blocks_before_the_next_step(model_dir, overlap):
    eng = make_engine(model_dir, async_scheduling=overlap)

    async def main():
        ae = AsyncEngine(eng)
        s = await ae.add_request({"prompt_token_ids": list(range(2, 60))}, SamplingParams(max_tokens=400, ignore_eos=True))
        got = 0
        async for out in s:
            got += len(out.outputs[0].token_ids)
            if got >= 3:
                break
        used = await ae.run_in_engine(lambda e: e.kv.pool.num_blocks - e.kv.num_free_blocks)
        s.abort()
        state = await ae.run_in_engine(lambda e: (pool_free(e), e.stats["generation_tokens"]))
        await asyncio.sleep(0.05)
        later = await ae.run_in_engine(lambda e: e.stats["generation_tokens"])
        await ae.shutdown()
        return used, state, later

    used, (free, gen_at_abort), gen_later = run(main())
    assert used >= 4  # 58 prompt tokens + a few generated, in blocks of 16
    assert free
    assert gen_later == gen_at_abort  # nothing ran for the aborted request after the abort


def test_add_request_errors_reach_the_caller(model_dir):
    eng = make_engine(model_dir, max_model_len=64)

    async def main():
        ae = AsyncEngine(eng)
        with pytest.raises(ValueError, match="context"):
            await ae.add_request({"prompt_token_ids": [5] * 64}, SamplingParams())
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("", SamplingParams())
        with pytest.raises(ValueError, match="out of range"):
            await ae.add_request({"prompt_token_ids": [5, 10_000]}, SamplingParams())
        # Hold the engine thread so the first "dup" cannot finish (and free its id) before the second.
        gate = threading.Event()
        held = asyncio.ensure_future(ae.run_in_engine(lambda eng: gate.wait(30)))
        first = asyncio.ensure_future(ae.add_request("t5 t6", SamplingParams(max_tokens=3), "dup"))
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_request("t5 t6", SamplingParams(max_tokens=3), "dup")
        gate.set()
        await held
        await collect(await first)
        ok = await ae.run_in_engine(pool_free)
        assert ae.num_unfinished == 0
        await ae.shutdown()
        return ok

    assert run(main())


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on(model_dir):
    eng = make_engine(model_dir)
    real_step = eng.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in the model")
        return real_step()

    eng.step = flaky_step

    async def main():
        ae = AsyncEngine(eng)
        # Hold the step thread until all three are queued, so the failing step holds all three.
        gate = threading.Event()
        held = asyncio.ensure_future(ae.run_in_engine(lambda _eng: gate.wait(30)))
        adds = [asyncio.ensure_future(ae.add_request(f"t{i + 5} t9", SamplingParams(max_tokens=50, ignore_eos=True)))
                for i in range(3)]
        await asyncio.sleep(0.05)
        gate.set()
        await held
        streams = [await a for a in adds]
        for s in streams:
            with pytest.raises(EngineStepError, match="boom in the model"):
                await collect(s)
        free = await ae.run_in_engine(pool_free)
        text, ids, finish = await collect(await ae.add_request("t5 t6", SamplingParams(max_tokens=4, ignore_eos=True)))
        await ae.shutdown()
        return free, ids, ae.stats["step_errors"]

    free, ids, errors = run(main())
    assert free and len(ids[0]) == 4 and errors == 1


def test_shutdown_ends_pending_streams_and_refuses_new_requests(model_dir):
    eng = make_engine(model_dir)

    async def main():
        ae = AsyncEngine(eng)
        s = await ae.add_request("t5 t6", SamplingParams(max_tokens=400, ignore_eos=True))
        await s.__anext__()
        await ae.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(s)
        with pytest.raises(EngineDeadError):
            await ae.add_request("t5", SamplingParams())
        assert not ae.is_running
        return pool_free(eng)

    assert run(main())


def test_the_event_loop_is_not_blocked_by_steps(model_dir):
    """While 8 requests decode, a 1 ms asyncio timer still fires on time: the model runs on the
    step thread. The worst lag is bounded by one GIL hand-off (the default switch interval, 5 ms),
    plus the longest kernel call that holds the GIL."""
    eng = make_engine(model_dir)

    async def main():
        ae = AsyncEngine(eng)
        streams = [await ae.add_request(f"t{i + 5} t9 t10", SamplingParams(max_tokens=60, ignore_eos=True))
                   for i in range(8)]
        readers = asyncio.gather(*(collect(s) for s in streams))
        lags = []
        while not readers.done():
            t = time.perf_counter()
            await asyncio.sleep(0.001)
            lags.append(time.perf_counter() - t - 0.001)
        await readers
        steps = eng.stats["steps"]
        await ae.shutdown()
        return np.array(lags), steps

    lags, steps = run(main())
    assert steps >= 60
    assert np.median(lags) < 0.01, f"median loop lag {np.median(lags) * 1e3:.1f} ms"
    assert np.percentile(lags, 99) < 0.1, f"p99 loop lag {np.percentile(lags, 99) * 1e3:.1f} ms"


def test_embed_runs_on_the_step_thread(model_dir):
    eng = make_engine(model_dir)

    async def main():
        ae = AsyncEngine(eng)
        res = await ae.embed(["t5 t6 t7", {"prompt_token_ids": [5, 6]}], pooling="mean")
        with pytest.raises(ValueError, match="pooling"):
            await ae.embed(["t5"], pooling="max")
        free = await ae.run_in_engine(pool_free)
        await ae.shutdown()
        return res, free

    res, free = run(main())
    assert free
    assert [n for _, n in res] == [3, 2]
    for vec, _ in res:
        assert vec.shape == (64,) and abs(np.linalg.norm(vec) - 1) < 1e-5
