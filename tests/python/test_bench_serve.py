"""benchmarks/serve.py and benchmarks/soak.py end to end on the CPU against the tiny random Llama (a
few clients, a few seconds of soak): the JSON they write holds what their docstrings promise and the
server answered no 5xx. Plus the helpers they share (benchmarks/serve_clients.py)."""
import json
import math
import os
import subprocess
import sys

import pytest

from server_harness import write_tiny_llama

BENCH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
sys.path.insert(0, BENCH)

import serve_clients as SC  # noqa: E402

TINY_FLAGS = ["--max-token-id", "300", "--max-model-len", "512", "--mem", "32", "--client-procs", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(write_tiny_llama(tmp_path_factory.mktemp("tiny_llama")))


def run_script(script: str, args: list[str], out: str) -> tuple[subprocess.CompletedProcess, dict]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, os.path.join(BENCH, script), *args, "--out", out], capture_output=True,
                       text=True, timeout=120, env=env)
    assert os.path.exists(out), r.stdout + r.stderr
    with open(out) as f:
        return r, json.load(f)


def test_serve_reports_vllm_fields_and_offline_beside(tiny, tmp_path):
    n, out_len = 8, 6
    r, res = run_script("serve.py", ["--w", tiny, "--clients", "4", "--num-prompts", str(n), "--output-len",
                                     str(out_len), "--input-len-min", "4", "--input-len-max", "40", *TINY_FLAGS],
                        str(tmp_path / "serve.json"))
    assert r.returncode == 0, r.stdout + r.stderr
    for line in ("Serving Benchmark Result", "Successful requests:", "Output token throughput (tok/s):",
                 "Total Token throughput (tok/s):", "P99 TTFT (ms):", "Median TPOT (ms):", "P90 ITL (ms):"):
        assert line in r.stdout
    s = res["server"]
    assert s["completed"] == n and s["failed"] == 0 and SC.count_5xx(s["status"]) == 0
    assert s["total_output_tokens"] == n * out_len  # ignore_eos: every request runs to max_tokens
    assert res["offline"]["output_tokens"] == n * out_len  # the same model work offline
    assert s["total_input_tokens"] == res["offline"]["input_tokens"]
    for key in ("ttft", "tpot", "itl"):
        for stat in ("mean", "median", "p90", "p99"):
            assert s[f"{stat}_{key}_ms"] > 0, (stat, key)
    assert s["median_ttft_ms"] <= s["p99_ttft_ms"]
    assert res["offline"]["steps"] > 0 and res["offline"]["step_ms"] > 0
    assert res["server_overhead"] == pytest.approx(1 - s["output_throughput"] / res["offline"]["output_throughput"])
    assert len(res["client_procs"]) == 2 and all(c["wall_s"] > 0 and c["cpu_s"] >= 0 for c in res["client_procs"])
    for key in ("device", "command", "git_revision"):
        assert key in res


def test_soak_rounds_and_rss_samples(tiny, tmp_path):
    clients = 24
    r, res = run_script("soak.py", ["--w", tiny, "--clients", str(clients), "--rounds", "2", "--output-len", "8",
                                    "--soak-minutes", "0.08", "--warmup-minutes", "0.02", "--soak-clients", "4",
                                    "--sample-s", "0.5", *TINY_FLAGS], str(tmp_path / "soak.json"))
    assert r.returncode == 0 and res["passed"], r.stdout + r.stderr
    assert len(res["rounds"]) == 2
    for rd in res["rounds"]:
        assert rd["jobs"] == clients and rd["http_5xx"] == 0 and rd["conn_errors"] == 0
        assert rd["completed"] + rd["disconnected"] == clients
        assert 0 < rd["disconnected"] < clients  # 30% leave (drawn per job from the fixed seed)
        assert rd["after"]["final"]["tallow:kv_cache_usage_perc"] == 0 and rd["new_request"]["ok"]
    soak = res["soak"]
    assert soak["http_5xx"] == 0 and soak["jobs"] > 0
    server = [p for p in soak["processes"] if p["pid"] == res["server_pid"]]
    assert server and server[0]["samples_after_warmup"] >= 2 and server[0]["max_mb"] > 0
    assert math.isfinite(server[0]["slope_mb_per_min"])


def test_percentiles_and_slope():
    p = SC.percentiles([float(x) for x in range(1, 101)], scale=2.0)
    assert p["mean"] == 101.0 and p["median"] == 101.0
    assert p["p90"] == pytest.approx(2 * 90.1) and p["p99"] == pytest.approx(2 * 99.01)
    assert all(math.isnan(v) for v in SC.percentiles([]).values())
    assert SC.slope_per_min([0, 30, 60, 90], [10, 11, 12, 13]) == pytest.approx(2.0)  # 1 MB per 30 s
    assert math.isnan(SC.slope_per_min([5], [1]))


def test_parse_metrics_sums_label_sets():
    text = ('# HELP tallow:kv_cache_usage_perc x\n# TYPE tallow:kv_cache_usage_perc gauge\n'
            'tallow:kv_cache_usage_perc{model_name="a"} 0.25\ntallow:kv_cache_usage_perc{model_name="b"} 0.5\n'
            'tallow:num_requests_running 3.0\n')
    m = SC.parse_metrics(text)
    assert m == {"tallow:kv_cache_usage_perc": 0.75, "tallow:num_requests_running": 3.0}


def test_descendants_finds_grandchildren():
    code = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
           "print('ok', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ok"
        tree = SC.descendants(child.pid)
        assert tree[0] == child.pid and len(tree) == 2
        assert all(SC.rss_mb(p) > 0 for p in tree)
    finally:
        for p in SC.descendants(child.pid)[::-1]:
            os.kill(p, 9)
        child.wait()


def test_split_workers_spreads_clients():
    assert SC.split_workers(10, 4) == [3, 3, 2, 2]
    assert SC.split_workers(2, 4) == [1, 1]
