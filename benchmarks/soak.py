"""Disconnect soak: many concurrent streaming clients, a share of them leaving mid-stream, against
`tallow serve`; then the RSS of the server and every process below it over a steady load.

Rounds (--rounds, default 3): --clients concurrent streams (default 1,000; /v1/completions with
token-id prompts, or --api chat), --disconnect-frac of them (default 0.3) closing their connection
after a random number of chunks (below --output-len). Those ask for --cut-max-tokens (default half
the context), so a request the server failed to abort would still be generating when the round
ends and hold its KV blocks past --settle-s. After each round: no 5xx, no connection or in-stream errors, the
KV-cache usage on /metrics (tallow:kv_cache_usage_perc) and the running / waiting gauges back to 0
within --settle-s, and a new request served in full.

RSS soak: --soak-clients streams in a closed loop with the same disconnect share for
--warmup-minutes + --soak-minutes (fractions allowed); every --sample-s the VmRSS of the server and
of each of its descendants (found by parent id under /proc: an engine process counts). Reported per
process: the first, last and largest sample after the warm-up and the least-squares slope (MB/min)
after it.

    python benchmarks/soak.py                                    # demo model, 1,000 clients, 10 min soak
    python benchmarks/soak.py --w folder/ --load-format dummy --d 0 --soak-minutes 10 --out result.json

Exit status 0 when every check passed, 1 otherwise (the JSON's "passed" and "failures" say which).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import serve_clients as SC  # noqa: E402

GAUGES = ("tallow:kv_cache_usage_perc", "tallow:num_requests_running", "tallow:num_requests_waiting")


def make_prompts(args) -> list:
    if args.api == "chat":
        rng = random.Random(args.seed)
        lens = [rng.randint(args.input_len_min, args.input_len_max) for _ in range(args.num_distinct_prompts)]
        words = ("story", "river", "seven", "lamp", "quiet", "orange", "market", "north", "paper", "window")
        return [" ".join(rng.choice(words) for _ in range(n)) for n in lens]
    return SC.random_prompts(args, args.num_distinct_prompts)


def gauges(server: SC.ServerProcess) -> dict:
    code, text = server.get("/metrics")
    if code != 200:
        return {"http_status": code}
    m = SC.parse_metrics(text)
    return {g: m.get(g) for g in GAUGES}


def settle(server: SC.ServerProcess, timeout: float) -> dict:
    """Poll /metrics until the KV usage and the request gauges read 0 (or `timeout` passes)."""
    t0 = time.monotonic()
    first = gauges(server)
    g = first
    while True:
        idle = all(g.get(k) == 0 for k in GAUGES)
        if idle or time.monotonic() - t0 > timeout:
            return {"right_after": first, "final": g, "idle": idle, "settle_s": round(time.monotonic() - t0, 3)}
        time.sleep(0.1)
        g = gauges(server)


def new_request(server: SC.ServerProcess, prompt, api: str) -> dict:
    body = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    if api == "chat":
        code, out = server.post_json("/v1/chat/completions", dict(body, messages=[{"role": "user", "content": prompt}]))
    else:
        code, out = server.post_json("/v1/completions", dict(body, prompt=prompt))
    n = (out.get("usage") or {}).get("completion_tokens")
    return {"status": code, "completion_tokens": n, "ok": code == 200 and n == 4}


def counts(merged: SC.ClientResult) -> dict:
    return {"jobs": merged.jobs, "completed": merged.completed, "disconnected": merged.disconnected,
            "status": {str(k): v for k, v in sorted(merged.status.items())}, "http_5xx": SC.count_5xx(merged.status),
            "other_http_errors": sum(v for k, v in merged.status.items() if 400 <= int(k) < 500),
            "conn_errors": merged.conn_errors, "stream_errors": merged.stream_errors, "errors": merged.errors}


def run_round(args, server, prompts, i: int) -> dict:
    spec = SC.ClientSpec(url=server.url, prompts=prompts, workers=0, output_len=args.output_len, api=args.api,
                         max_jobs=args.clients, disconnect_frac=args.disconnect_frac,
                         cut_max_tokens=args.cut_max_tokens, seed=args.seed + 1000 * (i + 1),
                         keep_latencies=False)
    results, wall = SC.run_clients(spec, args.clients, args.client_procs)
    out = dict(round=i + 1, wall_s=round(wall, 3), **counts(SC.merge(results)),
               client_procs=SC.client_cpu_report(results))
    out["after"] = settle(server, args.settle_s)
    out["new_request"] = new_request(server, prompts[0], args.api)
    out["health"] = server.get("/health")[0]
    return out


def rss_soak(args, server, prompts) -> dict:
    warm, total = 60 * args.warmup_minutes, 60 * (args.warmup_minutes + args.soak_minutes)
    spec = SC.ClientSpec(url=server.url, prompts=prompts, workers=0, output_len=args.output_len, api=args.api,
                         duration_s=total, disconnect_frac=args.disconnect_frac,
                         cut_max_tokens=args.cut_max_tokens, seed=args.seed, keep_latencies=False)
    pool = SC.ClientPool(spec, args.soak_clients, args.client_procs)
    t0 = pool.start()
    samples, labels = [], {}
    while True:
        t = time.monotonic() - t0
        row = {}
        for pid in SC.descendants(server.pid):
            mb = SC.rss_mb(pid)
            if mb is not None:
                row[pid] = mb
                labels.setdefault(pid, SC.process_label(pid))
        samples.append((t, row))
        if pool.wait(args.sample_s):
            break
    results = pool.join()
    procs = []
    for pid, label in labels.items():
        after = [(t, r[pid]) for t, r in samples if pid in r and t >= warm]
        every = [(t, r[pid]) for t, r in samples if pid in r]
        procs.append({"pid": pid, "process": label, "samples": len(every), "samples_after_warmup": len(after),
                      "start_mb": round(every[0][1], 1),
                      "first_mb": round(after[0][1], 1) if after else None,
                      "last_mb": round(after[-1][1], 1) if after else None,
                      "max_mb": round(max(v for _, v in after), 1) if after else None,
                      "slope_mb_per_min": round(SC.slope_per_min([t for t, _ in after], [v for _, v in after]), 3)})
    out = dict(clients=args.soak_clients, warmup_s=warm, soak_s=total - warm, sample_s=args.sample_s,
               **counts(SC.merge(results)), client_procs=SC.client_cpu_report(results), processes=procs,
               samples=[{"t_s": round(t, 2), "rss_mb": {str(k): round(v, 1) for k, v in r.items()}}
                        for t, r in samples])
    out["after"] = settle(server, args.settle_s)
    out["new_request"] = new_request(server, prompts[0], args.api)
    return out


def failures_of(part: str, r: dict) -> list[str]:
    f = []
    for key in ("http_5xx", "other_http_errors", "conn_errors", "stream_errors"):
        if r[key]:
            f.append(f"{part}: {r[key]} {key}")
    if not r["after"]["idle"]:
        f.append(f"{part}: gauges not back to 0 after {r['after']['settle_s']} s: {r['after']['final']}")
    if not r["new_request"]["ok"]:
        f.append(f"{part}: the new request was not served: {r['new_request']}")
    return f


def print_report(res: dict) -> None:
    print(f"{'round':<6} {'clients':>7} {'done':>6} {'cut':>5} {'5xx':>4} {'err':>4} {'wall s':>7} "
          f"{'kv after':>9} {'idle in s':>9} {'new req':>8}")
    for r in res["rounds"]:
        errs = r["other_http_errors"] + r["conn_errors"] + r["stream_errors"]
        kv = r["after"]["final"].get("tallow:kv_cache_usage_perc")
        print(f"{r['round']:<6} {r['jobs']:>7} {r['completed']:>6} {r['disconnected']:>5} {r['http_5xx']:>4} "
              f"{errs:>4} {r['wall_s']:>7.1f} {kv if kv is not None else 'n/a':>9} {r['after']['settle_s']:>9.2f} "
              f"{'ok' if r['new_request']['ok'] else 'FAILED':>8}")
    s = res.get("soak")
    if s:
        print(f"\nRSS soak: {s['soak_s'] / 60:.2f} min after {s['warmup_s'] / 60:.2f} min warm-up, {s['clients']} "
              f"clients, {s['jobs']} requests ({s['disconnected']} cut), {s['http_5xx']} 5xx")
        print(f"{'process':<40} {'first MB':>9} {'last MB':>9} {'max MB':>9} {'MB/min':>8}")
        for p in s["processes"]:
            print(f"{p['process'][:40]:<40} {p['first_mb'] or 0:>9.1f} {p['last_mb'] or 0:>9.1f} "
                  f"{p['max_mb'] or 0:>9.1f} {p['slope_mb_per_min']:>8.3f}")
    cpu = [c["cpu_util"] for r in res["rounds"] for c in r["client_procs"]]
    if cpu:
        print(f"\nclient processes: CPU / wall at most {max(cpu):.2f} in the rounds")
    print("PASSED" if res["passed"] else "FAILED:\n  " + "\n  ".join(res["failures"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    SC.add_model_args(p)
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--clients", type=int, default=1000, help="concurrent streams per round")
    p.add_argument("--client-procs", type=int, default=SC.default_client_procs())
    p.add_argument("--disconnect-frac", type=float, default=0.3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--settle-s", type=float, default=10.0, help="how long the gauges may take to read 0")
    p.add_argument("--soak-minutes", type=float, default=10.0, help="0 skips the RSS soak")
    p.add_argument("--warmup-minutes", type=float, default=1.0)
    p.add_argument("--soak-clients", type=int, default=64)
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--num-distinct-prompts", type=int, default=256)
    SC.add_workload_args(p, (8, 64), 32, "max_tokens of the clients that stay")
    p.add_argument("--cut-max-tokens", type=int, help="max_tokens of the clients that leave (default: half the "
                   "context)")
    args = p.parse_args(argv)
    SC.check_workload_args(p, args)
    if args.cut_max_tokens is None:
        args.cut_max_tokens = args.max_model_len // 2
    # a chat prompt's words are 1-2 tokens each, plus the template's
    if args.cut_max_tokens + 2 * args.input_len_max + 64 > args.max_model_len:
        p.error(f"--cut-max-tokens {args.cut_max_tokens} + the prompt may not fit --max-model-len "
                f"{args.max_model_len}")
    if not 0 <= args.disconnect_frac <= 1:
        p.error("--disconnect-frac must be in [0, 1]")
    prompts = make_prompts(args)
    flags = SC.model_flags(args) + SC.engine_flags(args)
    res = dict(SC.provenance(args.d), model=SC.model_flags(args)[-1], api=args.api, clients=args.clients,
               disconnect_frac=args.disconnect_frac, output_len=args.output_len, cut_max_tokens=args.cut_max_tokens,
               input_len=[args.input_len_min, args.input_len_max], engine_flags=flags, server_args=args.server_args,
               fd_limit=SC.raise_fd_limit(), rounds=[])
    server = SC.ServerProcess(flags + shlex.split(args.server_args) + ["--log-level", "warning"])
    res["server_pid"] = server.pid
    failures = []
    try:
        for i in range(args.rounds):
            r = run_round(args, server, prompts, i)
            res["rounds"].append(r)
            failures += failures_of(f"round {i + 1}", r)
            print(f"round {i + 1}: {r['completed']} completed, {r['disconnected']} cut, {r['http_5xx']} 5xx",
                  file=sys.stderr)
        if args.soak_minutes > 0:
            res["soak"] = rss_soak(args, server, prompts)
            failures += failures_of("soak", res["soak"])
    finally:
        res["server_exit_code"] = server.stop()
    res["failures"], res["passed"] = failures, not failures
    print_report(res)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
