"""The API process's CPU cost per engine step, without a model (issue 26).

A fake engine core (a spawned process speaking core_process.py's ZMQ/msgpack protocol) emits, every
--step-ms, one token for each of N running requests: byte-level BPE ids of real English text and code
(the demo model's GGUF tokenizer; this repository's docs as the text). The API process is the real
one: EngineCoreClient -> OutputProcessor -> RequestStreams -> the aiohttp handlers of server/serving.py,
read by real HTTP streaming clients (aiohttp, in separate processes) on /v1/completions or
/v1/chat/completions. Over the steady part of each round (every stream running) it reports the API
process's CPU time (process_time: every thread of it) per step and per token, the lag of each step
message (sent by the core -> handled by the client) and a split by the main thread's CPU clock:

    decode    msgspec decode of the step message
    outproc   OutputProcessor.process (detokenization, stop strings, RequestOutputs)
    dispatch  the rest of EngineCoreClient._handle (feeding the RequestStreams)
    json      serving's JSON encoding of the chunks (_json_bytes)
    rest      everything else: the handlers' per-delta work, aiohttp writes, the event loop

and, apart (it lands in whichever part allocated), the garbage collector's time and runs. The split's
own counters cost ~0.2 us a call; --no-split gives the clean total. --profile also prints cProfile's top
functions of each round's steady window.

    python benchmarks/bench_api_process.py                        # N = 64, 256; both endpoints
    python benchmarks/bench_api_process.py --streams 256 --endpoints chat --profile
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import pathlib
import shutil
import sys
import tempfile
import time

SPAWN = mp.get_context("spawn")
ROOT = pathlib.Path(__file__).resolve().parent.parent


# -- the fake engine core ----------------------------------------------------------------------
def fake_core(inp: str, out: str, ctrl, token_ids: list[int], step_s: float, eos_ids: list[int]) -> None:
    """Waits for the number of requests `ctrl` announces, then steps every step_s: one token for each
    running request (finish "length" at its max_tokens) until none runs; again for the next round."""
    import msgspec
    import zmq

    ctx = zmq.Context(io_threads=1)
    pull = ctx.socket(zmq.PULL)
    pull.bind(inp)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.bind(out)
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder()
    push.send(enc.encode(("ready", {"max_model_len": 4096, "dtype": "fake", "num_blocks": 1, "block_size": 16,
                                    "eos_ids": eos_ids})))
    running: dict[str, list] = {}  # engine request id -> [tokens out, max_tokens, position in token_ids]
    expected, steps, next_t = None, 0, 0.0
    n_tok = len(token_ids)
    while True:
        stepping = expected is not None and len(running) >= expected
        wait_ms = max(0, int((next_t - time.monotonic()) * 1000)) if stepping else 5
        while pull.poll(wait_ms):
            msg = dec.decode(pull.recv())
            if msg[0] == "add":
                for rid, p in msg[4]:
                    running[rid] = [0, p["max_tokens"], (hash(rid) & 0xFFFFFF) % n_tok]
            elif msg[0] in ("abort", "stop"):
                for rid in msg[1]:
                    running.pop(rid, None)
            elif msg[0] == "shutdown":
                ctx.destroy(linger=0)
                return
            wait_ms = 0
        if expected is None and not ctrl.empty():
            expected, steps = ctrl.get(), 0
        if expected is None or len(running) < expected and steps == 0:
            continue
        now = time.monotonic()
        if steps == 0 or next_t < now - step_s:  # the first step, or late: no burst to catch up
            next_t = now
        if now < next_t:
            continue
        if not running:  # the round is over
            expected = None
            push.send(enc.encode(("stats", {"num_running": 0, "steps": steps})))
            continue
        outs, done = [], []
        for rid, r in running.items():
            r[0] += 1
            finish = "length" if r[0] >= r[1] else None
            outs.append((rid, token_ids[(r[2] + r[0]) % n_tok], None, finish, None, r[0], 0))
            if finish:
                done.append(rid)
        for rid in done:
            del running[rid]
        steps += 1
        push.send(enc.encode(("out", outs, None, {"num_running": len(running), "steps": steps,
                                                  "sent_at": time.monotonic()})))
        next_t += step_s


# -- the streaming clients ---------------------------------------------------------------------
def client_proc(port: int, endpoint: str, n: int, max_tokens: int, results) -> None:
    import aiohttp

    async def one(session, i):
        if endpoint == "chat":
            url, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"Tell me story {i}."}]}
        else:
            url, body = "/v1/completions", {"prompt": f"Once upon a time, number {i},"}
        body.update(model="demo", stream=True, max_tokens=max_tokens)
        events, chars, buf = 0, 0, b""
        async with session.post(f"http://127.0.0.1:{port}{url}", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for data in resp.content.iter_any():
                buf += data
                *evs, buf = buf.split(b"\n\n")
                for ev in evs:
                    assert ev.startswith(b"data: "), ev[:80]
                    events += 1
                    if ev == b"data: [DONE]":
                        return events, chars, True
                    if i == 0:  # one stream per process parsed in full
                        c = json.loads(ev[6:])["choices"]
                        chars += sum(len(x.get("text") or x.get("delta", {}).get("content") or "") for x in c)
        return events, chars, False

    async def main():
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=600)) as s:
            return await asyncio.gather(*(one(s, i) for i in range(n)))

    res = asyncio.run(main())
    results.put((sum(r[0] for r in res), res[0][1], all(r[2] for r in res), time.process_time()))


# -- the API process ---------------------------------------------------------------------------
class Split:
    """CPU time totals of the API process's parts, and each step message's lag."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.t = dict(decode=0.0, outproc=0.0, dispatch=0.0, json=0.0)
        self.steps, self.tokens, self.lags = 0, 0, []
        self.gc_s, self.gc_runs, self._gc_t0 = 0.0, [0, 0, 0], 0.0

    def on_gc(self, phase, info):
        """gc.callbacks: the collector's time (it lands in whichever part allocated; reported apart)."""
        if phase == "start":
            self._gc_t0 = time.thread_time()
        else:
            self.gc_s += time.thread_time() - self._gc_t0
            self.gc_runs[info["generation"]] += 1


def instrument(client, split: Split, on: bool) -> None:
    """Count steps and tokens (and, with on, time the parts) of this client and of serving."""
    from tallow.server import serving

    handle, pc, mono = client._handle, time.thread_time, time.monotonic  # CPU, not wall: a shared machine

    if on:
        op = client.output_processor
        # the JSON encoder the chunks go through (_sse before _json_bytes existed: for A/B against old trees)
        enc_name = "_json_bytes" if hasattr(serving, "_json_bytes") else "_sse"
        process, enc, dec = op.process, getattr(serving, enc_name), client._dec

        class TimedDecoder:
            def decode(self, b):
                t = pc()
                r = dec.decode(b)
                split.t["decode"] += pc() - t
                return r

        def timed_process(outs, plp=None):
            t = pc()
            r = process(outs, plp)
            split.t["outproc"] += pc() - t
            return r

        def timed_json(obj):
            t = pc()
            r = enc(obj)
            split.t["json"] += pc() - t
            return r

        client._dec = TimedDecoder()
        op.process = timed_process
        setattr(serving, enc_name, timed_json)

    def counted_handle(msg):
        t = pc()
        before = split.t["outproc"]
        handle(msg)
        if msg[0] == "out":
            split.steps += 1
            split.tokens += len(msg[1])
            split.lags.append(mono() - msg[3]["sent_at"])
            split.t["dispatch"] += pc() - t - (split.t["outproc"] - before)

    client._handle = counted_handle


async def api_main(opts) -> list[dict]:
    from tallow.engine.args import EngineArgs
    from tallow.engine.core_client import CoreAddresses, EngineCoreClient
    from tallow.server.app import ServerConfig, build_app, start_server
    from tallow.server.demo_model import demo_model_path

    eargs = EngineArgs(model=demo_model_path(download=False))
    tmp = tempfile.mkdtemp(prefix="bench-api-")
    addrs = CoreAddresses(f"ipc://{tmp}/in", [f"ipc://{tmp}/out0"])
    from tallow.engine.core import load_model_source

    loaded = load_model_source(eargs)
    tok = loaded[2]
    text = "\n\n".join(p.read_text() for p in [ROOT / "docs" / "architecture.md", ROOT / "README.md"] if p.exists())
    token_ids = tok.encode(text, add_special_tokens=False)
    ctrl = SPAWN.Queue()
    core = SPAWN.Process(target=fake_core, args=(addrs.inp, addrs.outs[0], ctrl, token_ids, opts.step_ms / 1000,
                                                  [tok.eos_token_id] if getattr(tok, "eos_token_id", None) else []),
                         daemon=True)
    core.start()
    addrs.pid = core.pid
    client = EngineCoreClient(eargs, addrs, 0, core, tmp, loaded=loaded)
    await client.start(60)
    split = Split()
    instrument(client, split, not opts.no_split)
    import gc

    gc.callbacks.append(split.on_gc)
    runner, port = await start_server(build_app(client, ServerConfig(model_names=["demo"])), "127.0.0.1", 0)
    rows = []
    try:
        for n in opts.streams:
            for endpoint in opts.endpoints:
                rows.append(await one_round(opts, n, endpoint, port, ctrl, split))
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await runner.cleanup()
        await client.shutdown(10)
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


async def one_round(opts, n: int, endpoint: str, port: int, ctrl, split: Split) -> dict:
    steps, skip = opts.max_tokens, opts.max_tokens // 10
    results = SPAWN.Queue()
    per = [n // opts.client_procs + (i < n % opts.client_procs) for i in range(opts.client_procs)]
    split.reset()
    ctrl.put(n)
    procs = [SPAWN.Process(target=client_proc, args=(port, endpoint, k, steps, results)) for k in per if k]
    for p in procs:
        p.start()
    while split.steps < skip:  # the steady window: every stream running
        await asyncio.sleep(0.002)
    prof = None
    if opts.profile:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    snap = (time.process_time(), time.perf_counter(), split.steps, split.tokens, dict(split.t), len(split.lags),
            split.gc_s, list(split.gc_runs))
    while split.steps < steps - skip:
        await asyncio.sleep(0.002)
    cpu, wall = time.process_time() - snap[0], time.perf_counter() - snap[1]
    if prof is not None:
        prof.disable()
    k, toks = split.steps - snap[2], split.tokens - snap[3]
    parts = {name: (v - snap[4][name]) / k * 1e6 for name, v in split.t.items()}
    lags = sorted(split.lags[snap[5]:])
    got = [await asyncio.to_thread(results.get, True, 120) for _ in procs]
    for p in procs:
        p.join(30)
    row = {"endpoint": endpoint, "streams": n, "step_ms": opts.step_ms, "window_steps": k,
           "cpu_us_per_step": round(cpu / k * 1e6), "cpu_us_per_token": round(cpu / toks * 1e6, 2),
           "cpu_busy_frac": round(cpu / wall, 3), "steps_per_s": round(k / wall, 1),
           "lag_ms_p50": round(lags[len(lags) // 2] * 1e3, 2),
           "lag_ms_p99": round(lags[int(len(lags) * 0.99)] * 1e3, 2),
           "events": sum(g[0] for g in got), "all_done": all(g[2] for g in got),
           "client_cpu_s": round(sum(g[3] for g in got), 2)}
    row["gc_us_per_step"] = round((split.gc_s - snap[6]) / k * 1e6)
    row["gc_runs_by_generation"] = [a - b for a, b in zip(split.gc_runs, snap[7])]
    if not opts.no_split:
        row["split_us_per_step"] = {name: round(v) for name, v in parts.items()}
        row["split_us_per_step"]["rest"] = round(cpu / k * 1e6 - sum(parts.values()))
    if prof is not None:
        import io
        import pstats

        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(opts.profile_top)
        print(s.getvalue(), file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--endpoints", nargs="+", default=["completions", "chat"], choices=["completions", "chat"])
    ap.add_argument("--step-ms", type=float, default=10.0, help="the fake core's step interval")
    ap.add_argument("--max-tokens", type=int, default=300, help="tokens (steps) per stream and round")
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--no-split", action="store_true", help="no perf counters: the clean total")
    ap.add_argument("--profile", action="store_true", help="cProfile the steady window (stderr)")
    ap.add_argument("--profile-top", type=int, default=30)
    ap.add_argument("--json", help="write the rows here")
    opts = ap.parse_args()
    try:
        import uvloop
        rows = uvloop.run(api_main(opts))
    except ImportError:
        rows = asyncio.run(api_main(opts))
    if opts.json:
        pathlib.Path(opts.json).write_text(json.dumps({"argv": sys.argv[1:], "cpu": os.cpu_count(), "rows": rows},
                                                      indent=1))


if __name__ == "__main__":
    main()
