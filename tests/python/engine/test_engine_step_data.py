"""The engine core and its worker talk plain data (engine/step_data.py): every step the scheduler
hands the executor pickles, and a worker in another process (spawned, CPU), given only those pickled
steps, samples the same tokens as the engine's in-process worker.

The workload covers what a step message must carry: chunked prefills beside decodes (mixed steps),
prefix-cache hits, n > 1 completions sharing prompt blocks, a preemption (the request comes back
whole), requests that finish (stop ids, stop strings, lengths) and an abort, seeded sampling with
penalties, logit bias and logprobs, and prompt logprobs."""
import multiprocessing
import pickle

import numpy as np
import pytest

pytest.importorskip("torch", reason="transformers (with CPU torch) makes the random checkpoint")
pytest.importorskip("transformers", reason="transformers makes the random checkpoint")

from engine_models import assert_engine_idle, make_llama  # noqa: E402
from tallow import LLM, SamplingParams  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402

ENGINE = dict(dtype="float32", num_kv_blocks=20, block_size=8, max_num_seqs=6, prefill_chunk_size=16,
              max_num_batched_tokens=24)


def _replay(model_dir: str, engine_kw: dict, eos_ids: list, steps: list, conn) -> None:
    """In a spawned process: a worker built from the same engine arguments, fed the pickled steps;
    sends back each step's (request ids, sampled ids, logprobs, prompt logprobs)."""
    try:
        from tallow.engine.executor import load_source, worker_config
        from tallow.worker.worker import Worker

        args = EngineArgs(model=model_dir, **engine_kw)
        cfg, src = load_source(args)
        worker = Worker(cfg, src, worker_config(args, cfg, "cpu", eos_ids, overlap_depth=1))
        worker.initialize_cache(args.num_kv_blocks, 0)
        results = []
        for blob in steps:
            out = worker.execute_model(pickle.loads(blob)).result()
            results.append(pickle.dumps(out))
        conn.send(results)
    except BaseException as e:  # report, do not hang the parent
        conn.send(repr(e))
    finally:
        conn.close()


class _Recorded:
    def __init__(self, handle, outputs):
        self.handle, self.outputs = handle, outputs

    def result(self):
        out = self.handle.result()
        self.outputs.append(pickle.dumps(out))
        return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_step_data")
    make_llama(path, seed=11)
    return path


def test_steps_are_plain_data_and_replay_in_another_process(model_dir):
    llm = LLM(str(model_dir), **ENGINE)
    eng = llm.engine
    steps, outputs = [], []
    execute = eng.executor.execute_model

    def recording(step, mask_fn=None):
        blob = pickle.dumps(step)  # plain data: no live Request, KV manager or tokenizer in it
        assert "Request" not in str(type(step)) and b"KVCacheManager" not in blob and b"Tokenizer" not in blob
        steps.append(blob)
        return _Recorded(execute(step, mask_fn), outputs)

    eng.executor.execute_model = recording
    preempted = []
    orig_preempt = eng.scheduler._preempt
    eng.scheduler._preempt = lambda victim, out: (preempted.append(victim.request_id), orig_preempt(victim, out))

    rng = np.random.default_rng(4)
    shared = rng.integers(2, 320, 20).tolist()
    prompts = [shared + rng.integers(2, 320, int(n)).tolist() for n in (3, 9, 30)] + \
              [rng.integers(2, 320, int(n)).tolist() for n in (5, 41, 12)]
    params = [SamplingParams(temperature=0.8, seed=1, max_tokens=14, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=1.0, seed=2, max_tokens=12, n=2, repetition_penalty=1.3, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=1, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=3, max_tokens=18, frequency_penalty=0.5, presence_penalty=0.2,
                             logit_bias={5: 2.0}, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=10, stop=["t9"], ignore_eos=True),
              SamplingParams(temperature=0.9, seed=5, top_k=20, top_p=0.9, max_tokens=20, min_tokens=4,
                             stop_token_ids=[7, 8, 9], ignore_eos=True)]
    ids = [eng.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    aborted = eng.add_request({"prompt_token_ids": prompts[0][:7]},
                              SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for i in range(400):
        eng.step()
        if i == 5:
            eng.abort_request(aborted)
        if not eng.has_unfinished_requests():
            break
    assert not eng.has_unfinished_requests()
    assert_engine_idle(llm)
    assert preempted, "the small KV cache should force a preemption"
    assert len(steps) == len(outputs) > 10
    msgs = [pickle.loads(b) for b in steps]
    assert any(m.new_block_ids for m in msgs) and any(m.finished_req_ids for m in msgs)
    assert any(n.output_token_ids for m in msgs for n in m.new_reqs), "a preempted request comes back whole"
    assert any(n.num_computed_tokens for m in msgs for n in m.new_reqs), "a prefix-cache hit"
    assert len(ids) == 6

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_replay, args=(str(model_dir), ENGINE, sorted(eng.eos_ids), steps, child))
    proc.start()
    child.close()
    got = parent.recv() if parent.poll(600) else "timed out"
    proc.join(60)
    assert not isinstance(got, str), got
    assert len(got) == len(outputs)
    for k, (a, b) in enumerate(zip(outputs, got)):
        a, b = pickle.loads(a), pickle.loads(b)
        assert (a.req_ids, a.sampled_token_ids) == (b.req_ids, b.sampled_token_ids), f"step {k}"
        assert (a.logprobs is None) == (b.logprobs is None), f"step {k}"
        if a.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs):
                assert (x is None) == (y is None)
                if x is not None:
                    assert abs(x[0] - y[0]) < 1e-5 and x[1] == y[1]
        assert a.prompt_logprobs.keys() == b.prompt_logprobs.keys(), f"step {k}"
