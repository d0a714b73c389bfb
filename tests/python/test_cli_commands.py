"""The `tallow serve` commands users copy from candle-vllm's and vLLM's documentation: each flag parses
into the EngineArgs / ServerConfig setting it names there, a bad value is one line on stderr (exit 2),
and the settings do what they say on a live server (tool and reasoning parsers by their other names,
server-wide sampling defaults, a request naming another model, --log)."""
import argparse
import json
import os

import pytest

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")

from server_harness import CHAT_TEMPLATE, ScriptedEngine, ServerThread, post, write_tiny_llama  # noqa: E402
from tallow.engine.arg_parser import add_engine_args, engine_args_from  # noqa: E402
from tallow.server import cli  # noqa: E402
from tallow.server.parser_aliases import REASONING_PARSER_ALIASES, TOOL_PARSER_ALIASES, tool_parser_names  # noqa: E402
from tallow.server.tool_parsers import PARSERS  # noqa: E402


def resolve(*argv):
    """(EngineArgs, ServerConfig) of `tallow serve --w x ARGV` (no model is loaded)."""
    return cli.resolve(cli.build_parser().parse_args(["--w", "x", *argv]))


def run_main(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.err


# -- candle-vllm -------------------------------------------------------------------------------
@pytest.mark.parametrize("flag,dtype", [("bf16", "bfloat16"), ("f16", "float16"), ("f32", "float32"),
                                        ("half", "float16"), ("float", "float32"), ("BF16", "bfloat16"),
                                        ("auto", "auto"), ("bfloat16", "bfloat16"), ("float16", "float16")])
def test_dtype_names_of_candle_vllm_and_vllm(flag, dtype):
    assert resolve("--dtype", flag)[0].dtype == dtype


def test_kv_budget_flags():
    assert resolve("--kvcache-mem-gpu", "512")[0].mem == 512  # candle-vllm's name for --mem
    assert resolve("--mem", "300")[0].mem == 300
    assert resolve()[0].mem is None
    assert resolve("--gpu-memory-utilization", "0.6")[0].gpu_memory_fraction == 0.6  # vLLM's
    assert resolve()[0].gpu_memory_fraction == 0.9


@pytest.mark.parametrize("name,parser", [
    ("qwen_coder", "qwen3_coder"), ("qwen_xml", "qwen3_coder"), ("qwen", "qwen"), ("qwen_json", "hermes"),
    ("json", "json"), ("mistral", "mistral"),  # candle-vllm's --enforce-parser names
])
def test_candle_vllm_parser_names(name, parser):
    config = resolve("--enforce-parser", name)[1]
    assert config.tool_parser == parser
    assert PARSERS[config.tool_parser] is PARSERS[parser]


def test_server_wide_sampling_defaults_reach_engine_args():
    args = resolve("--temperature", "0", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05",
                   "--frequency-penalty", "0.1", "--presence-penalty", "0.2")[0]
    assert (args.temperature, args.top_k, args.top_p, args.min_p, args.frequency_penalty, args.presence_penalty) \
        == (0.0, 20, 0.9, 0.05, 0.1, 0.2)
    args = resolve()[0]
    assert (args.temperature, args.top_k, args.top_p, args.min_p, args.frequency_penalty, args.presence_penalty) \
        == (None,) * 6


def test_generate_keeps_its_own_temperature():
    """`tallow generate --temperature` is a per-run sampling parameter, not a server-wide default."""
    from tallow.cli import build_parser

    ns = build_parser().parse_args(["generate", "--w", "x", "--temperature", "0", "hi"])
    assert ns.temperature == 0.0 and engine_args_from(ns).temperature is None


# -- vLLM --------------------------------------------------------------------------------------
def test_kv_cache_dtype_and_prefix_caching():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    for value, want in (("fp8", "float8_e4m3"), ("fp8_e4m3", "float8_e4m3"), ("auto", "auto")):
        assert engine_args_from(p.parse_args(["--w", "x", "--d", "0", "--kv-cache-dtype", value])).kv_cache_dtype \
            == want
    assert engine_args_from(p.parse_args(["--w", "x"])).kv_cache_dtype == "auto"
    assert resolve("--enable-prefix-caching")[0].prefix_cache is True
    assert resolve("--no-enable-prefix-caching")[0].prefix_cache is False
    assert resolve("--no-prefix-cache")[0].prefix_cache is False
    assert resolve()[0].prefix_cache is True


@pytest.mark.parametrize("name,parser", [
    ("hermes", "hermes"), ("mistral", "mistral"), ("llama3_json", "llama3_json"), ("llama4_json", "llama3_json"),
    ("qwen3_coder", "qwen3_coder"), ("qwen3_xml", "qwen3_coder"), ("xlam", "json"),
])
def test_vllm_tool_call_parser_names(name, parser):
    assert resolve("--tool-call-parser", name)[1].tool_parser == parser


def test_every_accepted_parser_name_resolves_to_a_parser():
    names = tool_parser_names()
    assert set(PARSERS) <= set(names) and set(TOOL_PARSER_ALIASES) <= set(names)
    for name in names:
        assert resolve("--enforce-parser", name)[1].tool_parser in PARSERS


@pytest.mark.parametrize("name,mode", [("qwen3", "think"), ("deepseek_r1", "think"), ("deepseek_v3", "think"),
                                       ("glm45", "think"), ("think", "think"), ("none", "none"), ("auto", "auto")])
def test_reasoning_parser_names(name, mode):
    assert resolve("--reasoning-parser", name)[1].reasoning == mode
    assert resolve()[1].reasoning == "auto"


def test_auto_tool_choice_and_served_model_names():
    ns = cli.build_parser().parse_args(["--w", "x", "--enable-auto-tool-choice"])
    assert ns.enable_auto_tool_choice is True
    config = resolve("--served-model-name", "gpt-4-0613", "gpt-4")[1]
    assert list(config.model_names) == ["gpt-4-0613", "gpt-4"] and not config.model_names.strict
    assert resolve("--strict-model-name")[1].model_names.strict is True


# -- bad values: one line, exit 2 ----------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--dtype", "bf17"], "invalid choice: 'bf17'"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs a CUDA device"),
    (["--kv-cache-dtype", "fp8_e5m2"], "invalid choice: 'fp8_e5m2'"),
    (["--tool-call-parser", "pythonic"], "'pythonic'"),
    (["--tool-call-parser", "deepseek_v3"], "'deepseek_v3'"),
    (["--enforce-parser", "glm47_moe"], "'glm47_moe'"),
    (["--enforce-parser", "passthrough"], "'passthrough'"),
    (["--reasoning-parser", "granite"], "'granite'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-k", "x"], "--top-k"),
    (["--min-p", "2"], "min_p must be in [0, 1]"),
    (["--gpu-memory-utilization", "1.5"], "gpu_memory_fraction must be in (0, 1]"),
    (["--kvcache-mem-gpu", "0"], "mem must be a positive number of MB"),
    (["--log-file", "/nonexistent-dir/tallow.log"], "cannot write the log file /nonexistent-dir/tallow.log"),
])
def test_bad_values_are_one_line(argv, message, capsys):
    rc, err = run_main(["--w", "/nonexistent/model", *argv], capsys)
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if not ln.startswith("tallow serve: loading")]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err


def test_a_refused_parser_name_lists_the_accepted_ones(capsys):
    _, err = run_main(["--w", "x", "--tool-call-parser", "pythonic"], capsys)
    for name in ("hermes", "qwen3_coder", "qwen_coder", "llama3_json", "mistral", "json"):
        assert name in err
    _, err = run_main(["--w", "x", "--reasoning-parser", "granite"], capsys)
    assert all(name in err for name in ("think", "none", *REASONING_PARSER_ALIASES))


def test_help_names_the_aliases(capsys):
    rc, _ = run_main(["--help"], capsys)
    out = cli.build_parser().format_help()
    for flag in ("--kvcache-mem-gpu", "--gpu-memory-utilization", "--kv-cache-dtype", "--enable-prefix-caching",
                 "--no-enable-prefix-caching", "--tool-call-parser", "--enable-auto-tool-choice", "--reasoning-parser",
                 "--temperature", "--top-k", "--top-p", "--min-p", "--strict-model-name", "--log", "--log-file",
                 "bf16"):
        assert flag in out, flag
    assert rc == 0


# -- --log ---------------------------------------------------------------------------------------
def test_log_writes_tallow_log_in_the_working_directory(tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    (tmp_path / cli.DEFAULT_LOG_FILE).write_text("an old run\n")
    stderr_before = os.fstat(2)
    rc = cli.main(["--w", "/nonexistent/model", "--log"])  # fails loading, after the log file is set up
    err = capfd.readouterr().err
    assert rc == 2 and "/nonexistent/model" in err  # the terminal still gets it
    after = os.fstat(2)
    assert (after.st_dev, after.st_ino) == (stderr_before.st_dev, stderr_before.st_ino)  # stderr given back
    text = (tmp_path / cli.DEFAULT_LOG_FILE).read_text()
    # (pytest's capture writes print()s past fd 2; the subprocess test below sees them in the file)
    assert "/nonexistent/model" in text and "an old run" not in text


def test_the_log_file_copies_stderr_of_child_processes(tmp_path, capfd):
    import subprocess
    import sys

    from tallow.server.log_file import StderrTee

    tee = StderrTee(str(tmp_path / "x.log"))
    try:
        os.write(2, b"from this process\n")
        subprocess.run([sys.executable, "-c", "import sys; sys.stderr.write('from a child\\n')"], check=True)
    finally:
        tee.close()
    assert not tee.thread.is_alive()
    assert (tmp_path / "x.log").read_text() == "from this process\nfrom a child\n"
    assert capfd.readouterr().err == "from this process\nfrom a child\n"


# -- on a live server ----------------------------------------------------------------------------
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}]
QWEN_CODER_REPLY = ("<think>cold?</think>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n"
                    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture
def scripted(tmp_path):
    """A ServerThread on a scripted engine configured from `tallow serve` flags."""
    from engine_models import write_word_tokenizer
    from tallow.tokenizer import Tokenizer

    write_word_tokenizer(tmp_path, 100, eos_id=1)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHAT_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_pretrained_dir(tmp_path)
    servers = []

    def start(*argv):
        config = resolve("--served-model-name", "served", *argv)[1]
        engine = ScriptedEngine(tok)
        srv = ServerThread(engine, model_names=list(config.model_names), tool_parser=config.tool_parser,
                           reasoning=config.reasoning, strict_model_name=config.strict_model_name)
        servers.append(srv)
        return engine, srv

    yield start
    for srv in servers:
        srv.stop()


def test_candle_vllm_qwen_coder_and_vllm_qwen3_reasoning_parse_a_reply(scripted):
    for argv in (["--enforce-parser", "qwen_coder", "--reasoning-parser", "qwen3"],
                 ["--tool-call-parser", "qwen3_xml", "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1"]):
        engine, srv = scripted(*argv)
        engine.scripts.append([QWEN_CODER_REPLY[i:i + 4] for i in range(0, len(QWEN_CODER_REPLY), 4)])
        r = post(srv, "/v1/chat/completions", {"model": "served", "messages": [{"role": "user", "content": "t5"}],
                                                "tools": TOOLS})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning_content"] == "cold?"
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]] == \
            [("get_weather", {"city": "Bern", "days": 2})]
        assert r.json()["choices"][0]["finish_reason"] == "tool_calls"


def test_a_request_naming_another_model_is_answered_unless_strict(scripted):
    _, srv = scripted()
    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    r = client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "t5"}])
    assert r.model == "served" and r.choices[0].message.content == "Hello world!"
    r = client.completions.create(model="some/other-model", prompt="t5")
    assert r.model == "served"
    _, strict = scripted("--strict-model-name")
    r = post(strict, "/v1/chat/completions", {"model": "gpt-4o", "messages": [{"role": "user", "content": "t5"}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = post(strict, "/v1/chat/completions", {"model": "served", "messages": [{"role": "user", "content": "t5"}]})
    assert r.status_code == 200 and r.json()["model"] == "served"


def test_embeddings_and_tokenize_answer_another_model_name(tmp_path):
    from tallow.engine.args import EngineArgs
    from tallow.engine.engine import LLMEngine

    model = write_tiny_llama(tmp_path / "m", seed=4)
    srv = ServerThread(LLMEngine(EngineArgs(model=str(model), num_kv_blocks=32)), model_names=["served"])
    try:
        client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
        r = client.embeddings.create(model="text-embedding-3-small", input=["t5 t6", "t7"])
        assert r.model == "served" and len(r.data) == 2 and len(r.data[0].embedding) == 64
        r = post(srv, "/tokenize", {"model": "whatever", "prompt": "t5 t6"})
        assert r.status_code == 200 and r.json()["tokens"] == [5, 6]
    finally:
        srv.stop()


def test_server_sampling_defaults_sit_between_the_request_and_generation_config(tmp_path):
    """--temperature 0 makes a request that sets none greedy (whatever its seed); a request's own
    temperature wins; the flag wins over generation_config.json's temperature."""
    from tallow import LLM, SamplingParams

    model = write_tiny_llama(tmp_path / "m", seed=3)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.9, "top_k": 7}))
    args = resolve("--temperature", "0", "--top-p", "0.5")[0]
    llm = LLM(str(model), temperature=args.temperature, top_p=args.top_p, num_kv_blocks=32)
    ip = llm.engine.input_processor
    got = ip.apply_defaults(SamplingParams())
    assert (got.temperature, got.top_p, got.top_k) == (0.0, 0.5, 7)  # flag, flag, generation_config
    got = ip.apply_defaults(SamplingParams(temperature=1.0, top_p=1.0, top_k=-1))
    assert (got.temperature, got.top_p, got.top_k) == (1.0, 1.0, -1)  # the request's own

    prompt = {"prompt_token_ids": [5, 6, 7]}
    unset = [llm.generate(prompt, SamplingParams(seed=s, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
             for s in (1, 2)]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)[0]
    assert unset[0].outputs[0].token_ids == unset[1].outputs[0].token_ids == greedy.outputs[0].token_ids
    sampled = [llm.generate(prompt, SamplingParams(temperature=1.0, top_p=1.0, seed=s, max_tokens=6,
                                                   ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
               for s in (1, 2)]
    assert sampled[0] != sampled[1]  # the request's temperature 1 samples (random weights: near-uniform)


def test_a_copied_command_serves(tmp_path):
    """One `tallow serve` process started with the copied flags: the defaults reach the API process's
    input processing (a request without temperature decodes greedily whatever its seed), another model
    name is answered, the log file is written."""
    import re
    import signal
    import subprocess
    import sys
    import time

    model = write_tiny_llama(tmp_path / "tiny", seed=8)
    log = tmp_path / "serve.log"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    argv = ["--w", str(model), "--p", "0", "--dtype", "f32", "--kvcache-mem-gpu", "16", "--no-enable-prefix-caching",
            "--temperature", "0", "--top-k", "5", "--enforce-parser", "qwen_coder", "--reasoning-parser", "qwen3",
            "--served-model-name", "served", "--log-file", str(log), "--max-model-len", "256"]
    p = subprocess.Popen([sys.executable, "-m", "tallow.server", *argv], env=env, stderr=subprocess.PIPE, text=True)
    try:
        url, lines, deadline = None, [], time.monotonic() + 120
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line:
                break
            lines.append(line)
            m = re.search(r"at (http://[\w.]+:\d+)/v1", line)
            url = m.group(1) if m else None
        assert url, "".join(lines)
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "t5 t6"}]
        texts = [client.chat.completions.create(model="gpt-4o", messages=msgs, max_tokens=6, seed=s,
                                                extra_body={"ignore_eos": True})
                 for s in (1, 2)]
        greedy = client.chat.completions.create(model="served", messages=msgs, max_tokens=6, temperature=0,
                                                extra_body={"ignore_eos": True})
        assert [t.model for t in texts] == ["served", "served"]
        assert texts[0].choices[0].message.content == texts[1].choices[0].message.content == \
            greedy.choices[0].message.content
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            rc = p.wait(30)
        finally:
            if p.poll() is None:
                p.kill()
    assert rc == 0
    text = log.read_text()  # the API process's lines and the engine core process's log
    assert "tallow serve: served at http" in text and "engine core ready" in text and "shutting down" in text
