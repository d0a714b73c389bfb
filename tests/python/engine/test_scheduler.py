"""Scheduler unit tests with tiny caches: token budgets, chunked prefill, decode priority,
preemption by recompute, n > 1 siblings, and a pool that is entirely free at the end."""
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request, RequestStatus
from tallow.engine.sampling_params import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerConfig


def make(num_blocks=16, block_size=4, caching=True, **cfg):
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    return Scheduler(SchedulerConfig(**cfg), kv)


def req(rid, n_prompt, max_tokens=4, parent=None, base=0):
    return Request(rid, [base + i for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens), 1024, parent=parent)


def step(s, token=7):
    """One engine step with a fake model: every request that completes its sequence samples `token`."""
    out = s.schedule()
    for r in s.after_step(out):
        r.append_token(token)
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish_request(r, RequestStatus.FINISHED_LENGTH)
    return out


def run_to_end(s, limit=500):
    steps = []
    while s.has_unfinished and len(steps) < limit:
        steps.append(step(s))
    assert not s.has_unfinished
    assert s.kv.num_free_blocks == s.kv.pool.num_blocks
    return steps


def test_prefill_then_decode_batches():
    s = make(max_num_batched_tokens=64)
    a, b = req("a", 10), req("b", 6, base=50)
    s.add_request(a)
    s.add_request(b)
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 10, "b": 6}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    steps = run_to_end(s)
    assert len(steps) == 2 and a.output_token_ids == [7] * 4


def test_chunked_prefill_shares_batch_with_decodes():
    s = make(num_blocks=64, max_num_batched_tokens=8, prefill_chunk_size=8)
    a = req("a", 3, max_tokens=10)
    s.add_request(a)
    step(s)  # a prefilled
    long = req("long", 20, max_tokens=2, base=100)
    s.add_request(long)
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "long": 7}  # decode first, prefill takes the rest
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "long": 7}
    out = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "long": 6}
    assert long.num_output_tokens == 1
    run_to_end(s)


def test_prefill_chunk_size_limits_a_step():
    s = make(num_blocks=64, max_num_batched_tokens=100, prefill_chunk_size=5)
    r = req("r", 12, max_tokens=1)
    s.add_request(r)
    assert [step(s).num_scheduled_tokens["r"] for _ in range(3)] == [5, 5, 2]
    assert r.is_finished and s.kv.num_free_blocks == 64


def test_unchunked_prefill_waits_for_budget():
    s = make(num_blocks=64, max_num_batched_tokens=10, prefill_chunk_size=0)
    s.add_request(req("small", 4, max_tokens=3))
    s.add_request(req("big", 9, max_tokens=1, base=50))
    out = step(s)
    assert out.num_scheduled_tokens == {"small": 4}  # big (9) does not fit beside it; FCFS keeps order
    out = step(s)
    assert out.num_scheduled_tokens == {"small": 1, "big": 9}
    run_to_end(s)


def test_max_num_seqs():
    s = make(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(3):
        s.add_request(req(f"r{i}", 3, base=10 * i))
    out = step(s)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    run_to_end(s)


def test_preemption_by_recompute_and_resume():
    # 4 blocks of 2 tokens: two requests with 3-token prompts fit (2 blocks each) until decode
    s = make(num_blocks=4, block_size=2, caching=False, max_num_batched_tokens=64)
    a, b = req("a", 3, max_tokens=4), req("b", 3, max_tokens=4, base=10)
    s.add_request(a)
    s.add_request(b)
    step(s)  # both prefilled (3 tokens, 2 blocks each: the pool is full) and sampled a 4th token
    assert step(s).num_scheduled_tokens == {"a": 1, "b": 1}  # token 4 still fits in block 2
    out = step(s)  # both need a third block for token 5: b (admitted last) is preempted
    assert [r.request_id for r in out.preempted] == ["b"]
    assert out.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.output_token_ids == [7, 7]  # kept; recomputed from prompt + output later
    run_to_end(s)
    assert a.num_output_tokens == 4 and b.num_output_tokens == 4
    assert b.num_preemptions == 1


def test_abort_frees_blocks_immediately():
    s = make(num_blocks=8)
    a = req("a", 9, max_tokens=50)
    s.add_request(a)
    step(s)
    assert s.kv.num_free_blocks == 8 - 3
    s.abort("a")
    assert a.status == RequestStatus.FINISHED_ABORTED and s.kv.num_free_blocks == 8
    assert not s.has_unfinished
    s.add_request(req("w", 3))
    s.abort("w")  # aborting a waiting request
    assert not s.has_unfinished and s.kv.num_free_blocks == 8


def test_siblings_share_parent_prompt_blocks():
    s = make(num_blocks=16, block_size=4, caching=False, max_num_batched_tokens=64)
    parent = req("p", 10, max_tokens=3)
    kids = [req(f"p-{i}", 10, max_tokens=3, parent=parent) for i in (1, 2)]
    for r in (parent, *kids):
        s.add_request(r)
    out = step(s)
    assert out.num_scheduled_tokens == {"p": 10}  # siblings wait for the parent's prefill
    out = step(s)
    assert out.num_scheduled_tokens == {"p": 1, "p-1": 2, "p-2": 2}  # 8 prompt tokens shared
    assert s.kv.block_ids(kids[0])[:2] == s.kv.block_ids(parent)[:2] == s.kv.block_ids(kids[1])[:2]
    run_to_end(s)


def test_prefix_cache_computes_shared_system_prompt_once():
    s = make(num_blocks=32, block_size=4, max_num_batched_tokens=64)
    system = list(range(100, 116))
    a = Request("a", system + [1, 2], SamplingParams(max_tokens=1), 1024)
    s.add_request(a)
    run_to_end(s)
    b = Request("b", system + [3], SamplingParams(max_tokens=1), 1024)
    s.add_request(b)
    out = step(s)
    assert out.num_scheduled_tokens == {"b": 1} and b.num_cached_tokens == 16
    assert s.kv.prefix_cache_hit_rate > 0
    run_to_end(s)


def test_decode_batch_longest_context_first():
    """The engine orders a decode-only step's batch by context length, longest first (the attention
    grid then runs the longest CTAs first); a step with a prefill chunk keeps the scheduler's order."""
    from tallow.engine import core as E

    s = make(num_blocks=64, max_num_batched_tokens=256)
    lengths = {"a": 5, "b": 17, "c": 9, "d": 13}
    for rid, n in lengths.items():
        s.add_request(req(rid, n, max_tokens=8, base=100 * len(rid) + n))
    step(s)  # the prefills
    out = s.schedule()
    assert all(out.num_scheduled_tokens[r.request_id] == 1 for r in out.requests)
    fcfs = [r.request_id for r in out.requests]
    E._order_decode_batch(out)
    assert [r.request_id for r in out.requests] == ["b", "d", "c", "a"]
    assert [r.num_tokens for r in out.requests] == sorted((r.num_tokens for r in out.requests), reverse=True)
    # a step with a prefill chunk in it is left in the scheduler's order
    out.requests.sort(key=lambda r: fcfs.index(r.request_id))
    out.num_scheduled_tokens[out.requests[0].request_id] = 3
    E._order_decode_batch(out)
    assert [r.request_id for r in out.requests] == fcfs


def test_overlap_depth_setting(monkeypatch, caplog):
    """TALLOW_OVERLAP_DEPTH (tallow/envs.py): launched steps left unread (default 2, at least 1); a
    value that is not a whole number falls back to 2 with a warning naming the variable."""
    from tallow.engine import core as E

    for raw, want in (("", 2), ("1", 1), ("3", 3), ("0", 1), ("-4", 1)):
        monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", raw)
        assert E.overlap_depth() == want, raw
    monkeypatch.delenv("TALLOW_OVERLAP_DEPTH")
    assert E.overlap_depth() == 2
    monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", "two")
    with caplog.at_level("WARNING", logger="tallow"):
        assert E.overlap_depth() == 2
    assert "TALLOW_OVERLAP_DEPTH" in caplog.text and "'two'" in caplog.text


def test_step_data_sends_new_requests_once_then_only_changes():
    """The plain-data step (engine/step_data.py): a request goes to the worker whole once (prompt,
    parameters, blocks, cached prefix); afterwards only the block ids added since; finished and
    preempted requests are handled as the worker needs (finished: listed once; preempted: sent whole
    again when rescheduled). Every message pickles."""
    import pickle

    s = make(num_blocks=8, block_size=4, max_num_batched_tokens=64)
    a, b = req("a", 6, max_tokens=8), req("b", 3, max_tokens=8, base=50)
    s.add_request(a)
    s.add_request(b)

    def next_step():
        out = s.schedule()
        sample = [r for r in out.requests if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id]
                  >= r.num_tokens]
        msg = s.step_data(out, len(sample))
        assert pickle.loads(pickle.dumps(msg)) == msg
        for r in s.after_step(out):
            r.append_token(7)
        return msg

    m = next_step()
    assert m.req_ids == ["a", "b"] and m.num_scheduled_tokens == [6, 3] and m.num_sampled == 2
    assert [(n.req_id, n.prompt_token_ids, n.block_ids, n.num_computed_tokens) for n in m.new_reqs] == [
        ("a", list(range(6)), [0, 1], 0), ("b", [50, 51, 52], [2], 0)]
    assert not m.new_block_ids and not m.finished_req_ids
    m = next_step()  # a: 7 tokens, fits its 2 blocks; b: 4 tokens, fits its block
    assert m.req_ids == ["a", "b"] and m.num_scheduled_tokens == [1, 1] and not m.new_reqs and not m.new_block_ids
    m = next_step()  # a: 8 tokens (its 2 blocks), b: 5 tokens -> a new block for b
    assert not m.new_reqs and m.new_block_ids == {"b": s.kv.block_ids(b)[1:]}
    s.finish_request(a, RequestStatus.FINISHED_ABORTED)
    m = next_step()
    assert m.req_ids == ["b"] and m.finished_req_ids == ["a"]
    m = next_step()
    assert not m.finished_req_ids  # listed once
    # a preempted request comes back whole, with the tokens generated so far
    s._preempt(b, [])
    m = next_step()
    assert [n.req_id for n in m.new_reqs] == ["b"] and m.new_reqs[0].output_token_ids == [7] * 5
    assert m.new_reqs[0].block_ids == s.kv.block_ids(b)
