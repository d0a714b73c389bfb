"""What serve.py and soak.py share: the server under test as a subprocess, streaming clients spread
over several spawned processes (each an aiohttp event loop with its share of the clients, its own CPU
time reported), /metrics parsing, the RSS of a process tree, and the run's provenance.

A client process runs `workers` coroutines; each takes the next job index from a counter shared by
all processes (so no process runs dry while another still holds queued work), streams that job's
request and records it. A job is prompt `i % len(prompts)`; a fraction `disconnect_frac` of jobs
(drawn per job from `seed`) close their connection after a random number of chunks.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import os
import platform
import random
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Optional

SPAWN = mp.get_context("spawn")


# -- provenance ---------------------------------------------------------------------------------
def git_revision() -> Optional[str]:
    """HEAD of the checkout holding this file (+dirty with uncommitted changes), None outside git."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             timeout=30)
        if rev.returncode:
            return None
        dirty = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=30).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(gpu: Optional[str]) -> str:
    """The GPU's name when --d is given, else the CPU's model and core count."""
    if gpu is not None:
        try:
            name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i",
                                   str(gpu).split(",")[0]], capture_output=True, text=True, timeout=30).stdout.strip()
            return name or f"cuda:{gpu}"
        except (OSError, subprocess.SubprocessError):
            return f"cuda:{gpu} (nvidia-smi unavailable)"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu: {line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return f"cpu: {platform.processor() or platform.machine()} ({os.cpu_count()} cores)"


def provenance(gpu: Optional[str]) -> dict:
    return {"device": device_name(gpu), "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
            "git_revision": git_revision(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "load_average_at_start": os.getloadavg()}  # a shared machine's other work shows here


def default_client_procs() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))


def percentiles(xs: list[float], scale: float = 1.0) -> dict:
    """mean / median / p90 / p99 (linear interpolation), in `scale` units; NaN for an empty list."""
    if not xs:
        nan = float("nan")
        return {"mean": nan, "median": nan, "p90": nan, "p99": nan}
    s = sorted(xs)

    def q(p):
        k = (len(s) - 1) * p / 100
        lo, hi = int(k), min(int(k) + 1, len(s) - 1)
        return scale * (s[lo] + (s[hi] - s[lo]) * (k - lo))

    return {"mean": scale * sum(s) / len(s), "median": q(50), "p90": q(90), "p99": q(99)}


# -- the server under test ----------------------------------------------------------------------
def add_model_args(p) -> None:
    """The model and engine flags serve.py and soak.py share."""
    p.add_argument("--m", help="Hugging Face model id"), p.add_argument("--w", help="weights folder")
    p.add_argument("--f", help="GGUF file (default: the demo model)")
    p.add_argument("--d", help="GPU id (default: CPU)")
    p.add_argument("--load-format", help="dummy: random weights (the --w folder needs only config.json)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--num-threads", type=int)
    p.add_argument("--mem", type=int, help="KV-cache budget in MB")
    p.add_argument("--engine-args", default="", help="more engine flags (one string; serve.py: for both runs)")
    p.add_argument("--server-args", default="", help="more flags for the server only, e.g. '--api-server-count 2'")


def add_workload_args(p, input_len: tuple[int, int], output_len: int, output_help: str = "") -> None:
    """Random token-id prompts: lengths uniform in [--input-len-min, --input-len-max], ids up to
    --max-token-id, a fixed --seed; --output-len tokens each; --out for the JSON."""
    p.add_argument("--input-len-min", type=int, default=input_len[0])
    p.add_argument("--input-len-max", type=int, default=input_len[1])
    p.add_argument("--output-len", type=int, default=output_len, help=output_help or None)
    p.add_argument("--max-token-id", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write everything as JSON here")


def check_workload_args(p, args) -> None:
    if args.input_len_min < 1 or args.input_len_min > args.input_len_max:
        p.error("need 1 <= --input-len-min <= --input-len-max")


def random_prompts(args, n: int, rng: Optional[random.Random] = None) -> list[list[int]]:
    rng = rng or random.Random(args.seed)
    return [[rng.randint(0, args.max_token_id) for _ in range(rng.randint(args.input_len_min, args.input_len_max))]
            for _ in range(n)]


def model_flags(args) -> list[str]:
    for flag in ("f", "w", "m"):
        if getattr(args, flag):
            return [f"--{flag}", getattr(args, flag)]
    from tallow.server.demo_model import demo_model_path

    return ["--f", demo_model_path()]


def engine_flags(args, max_num_seqs: Optional[int] = None) -> list[str]:
    out = ["--max-model-len", str(args.max_model_len)]
    if max_num_seqs:
        out += ["--max-num-seqs", str(max_num_seqs)]
    if args.num_threads:
        out += ["--num-threads", str(args.num_threads)]
    if args.d is not None:
        out += ["--d", args.d]
    if args.load_format:
        out += ["--load-format", args.load_format]
    if args.mem:
        out += ["--mem", str(args.mem)]
    return out + shlex.split(args.engine_args or "")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raise_fd_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (inherited by the server and the clients): a thousand
    sockets do not fit under the common soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


class ServerProcess:
    """`python -m tallow.server FLAGS --p PORT` in a subprocess, ready once /health answers 200."""

    def __init__(self, flags: list[str], timeout: float = 600.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        self.cmd = [sys.executable, "-m", "tallow.server", *flags, "--host", "127.0.0.1", "--p", str(self.port)]
        self.proc = subprocess.Popen(self.cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.log: list[str] = []  # the last lines of its stderr, for the error message if it dies
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit("the server did not start (" + " ".join(self.cmd) + "):\n" + "".join(self.log[-30:]))
            time.sleep(0.2)

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)
            del self.log[:-200]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def post_json(self, path: str, body: dict, timeout: float = 120.0) -> tuple[int, dict]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                return e.code, json.loads(e.read())
            except ValueError:
                return e.code, {}

    def stop(self, timeout: float = 30.0) -> Optional[int]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


_METRIC_LINE = re.compile(r"^([A-Za-z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name: value}, summed over label sets (one model per server here)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and not line.startswith("#"):
            try:
                out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
            except ValueError:
                pass
    return out


# -- the RSS of a process tree --------------------------------------------------------------------
def descendants(pid: int) -> list[int]:
    """pid and every process below it (children found by scanning /proc for their parent id, so
    processes started by any thread count)."""
    parents: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])  # after "(comm)": state, ppid
        parents.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(parents.get(p, []))
    return out


def rss_mb(pid: int) -> Optional[float]:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def process_label(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return str(pid)
    mod = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "-m"), None)
    if "-c" in args and any("multiprocessing" in a for a in args):
        mod = "multiprocessing child"
    return f"{pid} {mod or os.path.basename(args[0]) if args else ''}".strip()


def slope_per_min(ts: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over ts (seconds), per minute; NaN with fewer than 2 points."""
    n = len(ts)
    if n < 2:
        return float("nan")
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 60.0 * sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var if var else float("nan")


# -- the clients ----------------------------------------------------------------------------------
@dataclass
class ClientSpec:
    """What one client process runs. Jobs are taken until `max_jobs` are taken (all processes
    together) or, with `duration_s`, until that long after the start."""
    url: str
    prompts: list  # token-id lists (completions) or strings (chat)
    workers: int
    output_len: int
    api: str = "completions"  # or "chat"
    max_jobs: Optional[int] = None
    duration_s: Optional[float] = None
    disconnect_frac: float = 0.0
    cut_max_tokens: Optional[int] = None  # max_tokens of a job that will disconnect (default output_len)
    seed: int = 0
    keep_latencies: bool = True  # per-request TTFT / ITL lists (serve.py); soak.py needs only counts
    model: Optional[str] = None
    request_timeout_s: float = 600.0


@dataclass
class ClientResult:
    pid: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0  # user + system of this process over the run
    start: float = 0.0  # time.monotonic() (system-wide on Linux, comparable across processes)
    end: float = 0.0
    jobs: int = 0
    completed: int = 0  # streamed to [DONE]
    disconnected: int = 0  # closed on purpose mid-stream
    status: dict = field(default_factory=dict)  # HTTP status -> count
    conn_errors: int = 0  # no HTTP status (refused, reset before the headers, timeout)
    stream_errors: int = 0  # an error event inside a 200 stream
    errors: list = field(default_factory=list)  # the first few error messages
    input_tokens: int = 0
    output_tokens: int = 0  # from each completed stream's usage
    ttft: list = field(default_factory=list)  # seconds, per completed request
    tpot: list = field(default_factory=list)  # (latency - ttft) / (output tokens - 1)
    itl: list = field(default_factory=list)  # seconds between chunks
    latency: list = field(default_factory=list)

    def note(self, msg: str) -> None:
        if len(self.errors) < 10:
            self.errors.append(msg)


def _request(spec: ClientSpec, prompt, max_tokens: int) -> tuple[str, dict]:
    common = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}}
    if spec.model:
        common["model"] = spec.model
    if spec.api == "chat":
        return "/v1/chat/completions", dict(common, messages=[{"role": "user", "content": prompt}])
    return "/v1/completions", dict(common, prompt=prompt)


async def _one(session, spec: ClientSpec, job: int, res: ClientResult) -> None:
    import aiohttp

    rng = random.Random(spec.seed * 1_000_003 + job)
    prompt = spec.prompts[job % len(spec.prompts)]
    cut = rng.randint(1, max(1, spec.output_len - 1)) if rng.random() < spec.disconnect_frac else None
    path, body = _request(spec, prompt, spec.output_len if cut is None else spec.cut_max_tokens or spec.output_len)
    t0 = time.perf_counter()
    first = last = None
    chunks, itl, usage = 0, [], None
    try:
        async with session.post(spec.url + path, json=body) as r:
            res.status[r.status] = res.status.get(r.status, 0) + 1
            if r.status != 200:
                res.note(f"HTTP {r.status}: {(await r.text())[:200]}")
                return
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                if line.startswith(b"data: [DONE]"):
                    break
                now = time.perf_counter()
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.stream_errors += 1
                    res.note(f"stream error: {json.dumps(chunk)[:200]}")
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if not chunk.get("choices"):
                    continue
                chunks += 1
                if first is None:
                    first = now
                else:
                    itl.append(now - last)
                last = now
                if cut is not None and chunks >= cut:
                    r.close()  # drop the connection: the server must abort the request and free its blocks
                    res.disconnected += 1
                    return
    except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as e:
        res.conn_errors += 1  # refused, reset, cut short or timed out: the server failed this client
        res.note(f"{type(e).__name__}: {e}")
        return
    res.completed += 1
    n_out = usage["completion_tokens"] if usage else chunks
    res.output_tokens += n_out
    res.input_tokens += usage["prompt_tokens"] if usage else (len(prompt) if isinstance(prompt, list) else 0)
    if spec.keep_latencies and first is not None:
        res.ttft.append(first - t0)
        res.latency.append(last - t0)
        res.itl.extend(itl)
        if n_out > 1:
            res.tpot.append((last - first) / (n_out - 1))


async def _client_loop(spec: ClientSpec, counter, start_at: float, res: ClientResult) -> None:
    import aiohttp

    deadline = start_at + spec.duration_s if spec.duration_s is not None else math.inf

    def next_job() -> Optional[int]:
        if time.monotonic() >= deadline:
            return None
        with counter.get_lock():
            i = counter.value
            if spec.max_jobs is not None and i >= spec.max_jobs:
                return None
            counter.value = i + 1
        return i

    async def worker(session):
        while (job := next_job()) is not None:
            res.jobs += 1
            await _one(session, spec, job, res)

    conn = aiohttp.TCPConnector(limit=0, force_close=spec.disconnect_frac > 0)
    timeout = aiohttp.ClientTimeout(total=spec.request_timeout_s)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:
        await asyncio.gather(*(worker(session) for _ in range(spec.workers)))


def _client_main(spec: ClientSpec, counter, ready, go, start_at, out) -> None:
    """One client process: import everything, say ready, wait for the common start, run, report."""
    try:
        import uvloop  # the client should be no slower than the server's loop

        run = uvloop.run
    except (ImportError, AttributeError):
        run = asyncio.run
    import aiohttp  # noqa: F401 - imported before the clock starts

    ready.release()
    go.wait()
    res = ClientResult(pid=os.getpid())
    t_cpu = os.times()
    res.start = time.monotonic()
    try:
        run(_client_loop(spec, counter, start_at.value, res))
    except Exception as e:  # noqa: BLE001 - reported to the parent instead of a silent hang
        res.note(f"client process failed: {type(e).__name__}: {e}")
        res.conn_errors += 1
    res.end = time.monotonic()
    t = os.times()
    res.cpu_s = (t.user - t_cpu.user) + (t.system - t_cpu.system)
    res.wall_s = res.end - res.start
    out.put(res)


def split_workers(total: int, procs: int) -> list[int]:
    procs = max(1, min(procs, total))
    return [total // procs + (1 if i < total % procs else 0) for i in range(procs)]


class ClientPool:
    """`procs` spawned client processes sharing `clients` workers and one job counter. start() waits
    until every process is ready, then starts them at once; join() returns their results."""

    def __init__(self, spec: ClientSpec, clients: int, procs: int):
        self.counter = SPAWN.Value("q", 0)
        self.ready = SPAWN.Semaphore(0)
        self.go = SPAWN.Event()
        self.start_at = SPAWN.Value("d", 0.0)
        self.out = SPAWN.Queue()
        self.shares = split_workers(clients, procs)
        self.procs = []
        for n in self.shares:
            s = ClientSpec(**dict(spec.__dict__, workers=n))
            p = SPAWN.Process(target=_client_main, args=(s, self.counter, self.ready, self.go, self.start_at, self.out),
                            daemon=True)
            p.start()
            self.procs.append(p)
        for _ in self.procs:
            if not self.ready.acquire(timeout=120):
                raise SystemExit("a client process did not start")
        self.t0 = 0.0
        self.results: list[ClientResult] = []

    def start(self) -> float:
        self.start_at.value = self.t0 = time.monotonic()
        self.go.set()
        return self.t0

    def wait(self, timeout: float) -> bool:
        """Collect results for up to `timeout` seconds; True once every process has reported."""
        import queue

        end = time.monotonic() + timeout
        while len(self.results) < len(self.procs):
            left = end - time.monotonic()
            if left <= 0:
                return False
            try:
                self.results.append(self.out.get(timeout=left))
            except queue.Empty:
                if not any(p.is_alive() for p in self.procs):  # all gone: what they sent is in the pipe
                    try:
                        self.results.append(self.out.get(timeout=5))
                    except queue.Empty:
                        raise SystemExit("a client process died without reporting") from None
        return True

    def join(self) -> list[ClientResult]:
        while not self.wait(60.0):
            pass
        for p in self.procs:
            p.join(30)
        return self.results


def run_clients(spec: ClientSpec, clients: int, procs: int) -> tuple[list[ClientResult], float]:
    """Run the spec over `procs` processes; (their results, the wall time from the common start to the
    last process's end)."""
    pool = ClientPool(spec, clients, procs)
    t0 = pool.start()
    results = pool.join()
    return results, max(r.end for r in results) - t0


def merge(results: list[ClientResult]) -> ClientResult:
    m = ClientResult()
    for r in results:
        for k in ("jobs", "completed", "disconnected", "conn_errors", "stream_errors", "input_tokens",
                  "output_tokens"):
            setattr(m, k, getattr(m, k) + getattr(r, k))
        for k, v in r.status.items():
            m.status[k] = m.status.get(k, 0) + v
        for k in ("ttft", "tpot", "itl", "latency"):
            getattr(m, k).extend(getattr(r, k))
        for e in r.errors:
            m.note(e)
    return m


def client_cpu_report(results: list[ClientResult]) -> list[dict]:
    """Per client process: CPU seconds over wall seconds (1.0 = one core saturated)."""
    return [{"pid": r.pid, "wall_s": round(r.wall_s, 3), "cpu_s": round(r.cpu_s, 3),
             "cpu_util": round(r.cpu_s / r.wall_s, 3) if r.wall_s else None} for r in results]


def count_5xx(status: dict) -> int:
    return sum(v for k, v in status.items() if int(k) >= 500)
