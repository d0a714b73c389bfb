"""The engine core in its own process (core_process.py) behind EngineCoreClient (core_client.py), on a
tiny random Llama: the same tokens as the in-process LLM, aborts and stop strings reach the core (KV
back to zero), embeddings in chunks, and a core that dies fails every stream instead of hanging."""
import asyncio
import os
import signal
import time

import numpy as np
import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from server_harness import collect, write_tiny_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.core_client import EngineCoreClient  # noqa: E402
from tallow.engine.errors import EngineDeadError  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


def args(model_dir, **kw):
    kw.setdefault("num_kv_blocks", 64)
    kw.setdefault("max_model_len", 128)
    return EngineArgs(model=str(model_dir), **kw)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


async def wait_stats(client, pred, timeout=10.0):
    t = time.monotonic()
    while not pred(client.stats):
        assert time.monotonic() - t < timeout, f"stats never matched: {client.stats}"
        await asyncio.sleep(0.02)


def test_same_outputs_as_the_in_process_engine(model_dir):
    """Greedy, seeded sampling with n > 1, stop strings, log-probs: token for token and text for text
    what LLM.generate (in-process) returns for the same requests."""
    rng = np.random.default_rng(7)
    prompts = [rng.integers(2, 320, int(n)).tolist() for n in rng.integers(3, 30, 4)] + ["t5 t6 t7", "t9 t10"]
    params = [SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=16, n=3),
              SamplingParams(temperature=0.0, max_tokens=30, stop=["t119"], ignore_eos=True),
              SamplingParams(temperature=0.7, top_k=20, seed=3, max_tokens=12, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=1),
              SamplingParams(temperature=1.0, seed=5, max_tokens=24, stop_token_ids=[17])]
    wrapped = [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts]
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=128)
    offline = [llm.generate([w], p)[0] for w, p in zip(wrapped, params)]

    async def main():
        client = await EngineCoreClient.launch(args(model_dir))
        try:
            streams = [await client.add_request(w, p, f"r{i}") for i, (w, p) in enumerate(zip(wrapped, params))]
            res = await asyncio.gather(*(collect(s) for s in streams))
            await wait_stats(client, lambda s: s.get("kv_usage") == 0.0 and s.get("num_running") == 0)
            return res
        finally:
            await client.shutdown()

    results = run(main())
    for (text, ids, finish), ref in zip(results, offline):
        assert len(ids) == len(ref.outputs)
        for o in ref.outputs:
            assert ids[o.index] == o.token_ids
            assert text[o.index] == o.text
            assert finish[o.index] == o.finish_reason


def test_abort_and_stop_strings_free_the_cache(model_dir):
    async def main():
        client = await EngineCoreClient.launch(args(model_dir, max_model_len=512))
        try:
            long = await client.add_request({"prompt_token_ids": list(range(2, 60))},
                                            SamplingParams(max_tokens=400, ignore_eos=True, temperature=0))
            got = 0
            async for out in long:
                got += len(out.outputs[0].token_ids)
                if got >= 3:
                    break
            assert client.stats["kv_usage"] > 0
            long.abort()
            await wait_stats(client, lambda s: s["kv_usage"] == 0.0 and s["num_running"] == 0)
            gen = client.stats["generation_tokens"]
            await asyncio.sleep(0.2)
            assert client.stats["generation_tokens"] == gen  # nothing ran for it after the abort
            assert client.num_unfinished == 0 and not client.output_processor.groups
            # a stop string found in the API process ends the request in the core
            s = await client.add_request("t5 t6", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
            text, ids, finish = await collect(s)
            words = text[0].split()
            stop = words[2]
            s = await client.add_request("t5 t6", SamplingParams(temperature=0, max_tokens=60, ignore_eos=True,
                                                                stop=[stop]))
            text2, ids2, finish2 = await collect(s)
            assert finish2[0] == "stop" and stop not in text2[0] and len(ids2[0]) < 60
            await wait_stats(client, lambda s: s["kv_usage"] == 0.0 and s["num_running"] == 0)
        finally:
            await client.shutdown()

    run(main())


def test_embeddings_in_chunks_match_the_in_process_engine(model_dir):
    from tallow.engine.engine import LLMEngine

    inputs = [list(range(2, 70)), "t5 t6 t7"]
    ref = LLMEngine(args(model_dir)).embed([{"prompt_token_ids": inputs[0]}, inputs[1]], pooling="mean")

    async def main():
        client = await EngineCoreClient.launch(args(model_dir, prefill_chunk_size=16))  # 68 tokens: 5 chunks
        try:
            got = await client.embed([{"prompt_token_ids": inputs[0]}, inputs[1]], pooling="mean")
            await wait_stats(client, lambda s: s["kv_usage"] == 0.0 and s.get("num_embed_jobs") == 0)
            return got
        finally:
            await client.shutdown()

    for (v, n), (rv, rn) in zip(run(main()), ref):
        assert n == rn
        np.testing.assert_allclose(v, rv, rtol=2e-5, atol=2e-6)


def test_bad_requests_raise_before_anything_is_queued(model_dir):
    async def main():
        client = await EngineCoreClient.launch(args(model_dir))
        try:
            with pytest.raises(ValueError, match="longer than|context|max_model_len|exceed"):
                await client.add_request({"prompt_token_ids": list(range(2, 300))}, SamplingParams())
            with pytest.raises(ValueError, match="vocabulary|out of range"):
                await client.add_request({"prompt_token_ids": [5, 100000]}, SamplingParams())
            s = await client.add_request("t5", SamplingParams(max_tokens=4), "same")
            with pytest.raises(ValueError, match="already in use"):
                await client.add_request("t6", SamplingParams(max_tokens=4), "same")
            await collect(s)
            assert client.num_unfinished == 0
        finally:
            await client.shutdown()

    run(main())


def test_a_killed_core_fails_every_stream_and_calls_on_dead(model_dir):
    async def main():
        client = await EngineCoreClient.launch(args(model_dir))
        died = []
        client.on_dead.append(died.append)
        try:
            s = await client.add_request({"prompt_token_ids": list(range(2, 40))},
                                         SamplingParams(max_tokens=100, ignore_eos=True))
            async for _ in s:
                break
            assert client.is_running
            os.kill(client.addrs.pid, signal.SIGKILL)
            t = time.monotonic()
            with pytest.raises(EngineDeadError):
                async for _ in s:
                    pass
            assert time.monotonic() - t < 5
            assert not client.is_running and died and isinstance(client.dead_error, EngineDeadError)
            with pytest.raises(EngineDeadError):
                await client.add_request("t5", SamplingParams())
            with pytest.raises(EngineDeadError):
                await client.embed(["t5"])
        finally:
            await client.shutdown()

    run(main())


def test_a_model_that_cannot_load_leaves_no_process(model_dir, tmp_path):
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises((ValueError, OSError)):
        run(EngineCoreClient.launch(EngineArgs(model=str(tmp_path / "missing"))))
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_embeddings_do_not_stall_streams_and_stop_when_their_caller_leaves(model_dir):
    """An embeddings job runs one prefill chunk between two steps: a stream started beside a big job
    keeps getting tokens and finishes first; a cancelled job is dropped in the core (blocks freed)."""
    async def main():
        client = await EngineCoreClient.launch(args(model_dir, max_model_len=512, prefill_chunk_size=16))
        try:
            inputs = [{"prompt_token_ids": list(range(2 + i, 300 + i))} for i in range(8)]  # 8 x 298 tokens
            job = asyncio.ensure_future(client.embed(inputs, pooling="mean"))
            await wait_stats(client, lambda s: s.get("num_embed_jobs") == 1)
            s = await client.add_request("t5 t6", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
            text, ids, finish = await collect(s)
            assert len(ids[0]) == 8 and not job.done()  # the stream ended while the job still ran
            got = await job
            assert len(got) == 8 and all(n == 298 for _, n in got)
            # a caller that leaves: its job is dropped and its blocks return
            job = asyncio.ensure_future(client.embed(inputs, pooling="last"))
            await wait_stats(client, lambda s: s.get("num_embed_jobs") == 1 and s["kv_usage"] > 0)
            job.cancel()
            await wait_stats(client, lambda s: s.get("num_embed_jobs") == 0 and s["kv_usage"] == 0.0)
        finally:
            await client.shutdown()

    run(main())
