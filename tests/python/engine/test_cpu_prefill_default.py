"""The prefill chunk and step token budget default by device (engine/args.py default_batching): on the
CPU both shrink so one long prompt cannot stall the other streams for its whole prefill (issue 26); a GPU
keeps 8192; a value the user gives always wins. No timing here: benchmarks/cpu_prefill_chunk.py measures."""
import argparse

import pytest

from server_harness import write_tiny_llama
from tallow.engine.arg_parser import add_engine_args, engine_args_from
from tallow.engine.args import CPU_PREFILL_CHUNK, GPU_PREFILL_CHUNK, EngineArgs, default_batching
from tallow.engine.engine import LLMEngine
from tallow.engine.kv_cache_manager import KVCacheManager
from tallow.engine.request import Request, RequestStatus
from tallow.engine.sampling_params import SamplingParams
from tallow.engine.scheduler import Scheduler, SchedulerConfig


def test_cpu_default_is_smaller_than_the_gpu_default():
    assert 0 < CPU_PREFILL_CHUNK < GPU_PREFILL_CHUNK == 8192
    # the budget holds one chunk, and every running decode (max_num_seqs) so none is left out of a step
    assert default_batching("cpu", None, None, max_num_seqs=4) == (CPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK)
    assert default_batching("cpu", None, None, max_num_seqs=4096) == (CPU_PREFILL_CHUNK, 4096)
    args = EngineArgs(model="unused")
    assert (args.prefill_chunk_size, args.max_num_batched_tokens) == (CPU_PREFILL_CHUNK,
                                                                      max(CPU_PREFILL_CHUNK, args.max_num_seqs))


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_gpu_keeps_8192(device):
    assert default_batching(device, None, None) == (8192, 8192)
    args = EngineArgs(model="unused", device=device)  # resolving needs no GPU
    assert (args.prefill_chunk_size, args.max_num_batched_tokens) == (8192, 8192)
    assert default_batching(device, 512, None) == (512, 8192)  # the old rule: budget max(8192, chunk)
    assert default_batching(device, 16384, None) == (16384, 16384)


@pytest.mark.parametrize("chunk, budget, expected", [
    (2048, None, (2048, 2048)),  # a bigger chunk than the default: the budget grows to hold it
    (16, None, (16, CPU_PREFILL_CHUNK)),  # a smaller one: decodes still fit beside it
    (None, 4096, (CPU_PREFILL_CHUNK, 4096)),
    (300, 100, (300, 100)),  # both explicit: kept as given
    (0, None, (0, 8192)),  # chunking off: a step must hold a whole prompt
])
def test_explicit_values_win_on_cpu(chunk, budget, expected):
    assert default_batching("cpu", chunk, budget, max_num_seqs=8) == expected
    args = EngineArgs(model="unused", prefill_chunk_size=chunk, max_num_batched_tokens=budget, max_num_seqs=8)
    assert (args.prefill_chunk_size, args.max_num_batched_tokens) == expected


def test_bad_values_are_still_rejected():
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        EngineArgs(model="unused", prefill_chunk_size=-1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineArgs(model="unused", max_num_batched_tokens=0)


def _cli(*flags):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_args_from(p.parse_args(["--m", "unused", "--max-num-seqs", "8", *flags]))


def test_cli_flags_win_and_no_flag_gets_the_device_default():
    a = _cli()
    assert (a.prefill_chunk_size, a.max_num_batched_tokens) == (CPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK)
    a = _cli("--prefill-chunk-size", "8192")
    assert (a.prefill_chunk_size, a.max_num_batched_tokens) == (8192, 8192)
    a = _cli("--max-num-batched-tokens", "1000")
    assert (a.prefill_chunk_size, a.max_num_batched_tokens) == (CPU_PREFILL_CHUNK, 1000)


def test_cpu_engine_built_with_defaults_uses_them(tmp_path):
    model = write_tiny_llama(tmp_path / "m")
    engine = LLMEngine(EngineArgs(model=str(model), num_kv_blocks=64, max_model_len=512, max_num_seqs=8))
    cfg = engine.scheduler.config
    assert (cfg.prefill_chunk_size, cfg.max_num_batched_tokens) == (CPU_PREFILL_CHUNK, CPU_PREFILL_CHUNK)
    assert engine.embed_chunk_tokens == CPU_PREFILL_CHUNK  # embeddings are cut the same way
    engine.shutdown()
    engine = LLMEngine(EngineArgs(model=str(model), num_kv_blocks=64, max_model_len=512, prefill_chunk_size=64,
                                  max_num_batched_tokens=200))
    assert (engine.scheduler.config.prefill_chunk_size, engine.scheduler.config.max_num_batched_tokens) == (64, 200)
    engine.shutdown()


def test_cpu_step_holds_at_most_one_chunk_however_many_prompts_wait():
    """With the CPU default, decodes run every step and several long prompts waiting together do not add
    a chunk each to one step (as they did under the old 8192-token budget)."""
    chunk, budget = default_batching("cpu", None, None, max_num_seqs=16)
    assert budget == chunk
    s = Scheduler(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, prefill_chunk_size=chunk),
                  KVCacheManager(4096, 16, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=10_000, ignore_eos=True)
    decodes = [Request(f"d{i}", [i + 1] * 4, params, 100_000) for i in range(4)]
    for r in decodes:
        s.add_request(r)
    out = s.schedule()
    for r in s.after_step(out):
        r.append_token(7)
    for i in range(3):
        s.add_request(Request(f"long{i}", [100 + i] * (3 * chunk), params, 100_000))
    long_left = 3 * 3 * chunk
    steps = 0
    while long_left > 0:
        out = s.schedule()
        steps += 1
        assert out.total_tokens <= budget
        assert all(out.num_scheduled_tokens.get(r.request_id) == 1 for r in decodes)  # no decode waits
        long_left -= sum(n for rid, n in out.num_scheduled_tokens.items() if rid.startswith("long"))
        for r in s.after_step(out):
            r.append_token(7)
        assert steps < 100
    for r in list(s.running):
        s.finish_request(r, RequestStatus.FINISHED_ABORTED)
