"""MCP tools in the chat endpoint (--mcp-config): the test MCP server (mcp_test_server.py, over stdio)
started from an mcp.json the tests write; a chat that needs the calculator gets the right answer
through one or more tool rounds, streaming and not; a crashed MCP server gives the request a tool
error and is restarted for the next; and `tallow serve` with a broken mcp.json, a missing command or
a server that never answers exits with one line and status 1.

The "model" is a scripted engine that behaves like a tool-using model: it reads the prompt it is
given and calls the calculator on the next expression of the user's question, or, once the prompt
holds a tool result per expression, answers with those results. So the answer is right only if the
MCP server really computed it and the result reached the next round's prompt."""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

pytest.importorskip("mcp")
requests = pytest.importorskip("requests")

from engine_models import write_word_tokenizer  # noqa: E402
from server_harness import CHAT_TEMPLATE, ScriptedEngine, ServerThread, post, write_tiny_llama  # noqa: E402
from tallow.server.mcp_config import McpConfigError, McpSettings, load_mcp_config, parse_mcp_config  # noqa: E402
from tallow.server.mcp_tools import MCP_HUB, start_hub  # noqa: E402
from tallow.tokenizer import Tokenizer  # noqa: E402

SERVER_PY = os.path.join(os.path.dirname(__file__), "mcp_test_server.py")
TOOL_TURN = re.compile(r"t2 tool (.*?) t3")  # a tool message as CHAT_TEMPLATE renders it


def write_config(tmp_path, timeout=30, **extra) -> str:
    cfg = {"mcpServers": {"calc": {"command": sys.executable, "args": [SERVER_PY], "timeout": timeout}, **extra}}
    path = tmp_path / "mcp.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def call_text(name: str, args: dict) -> str:
    return '<tool_call>\n{"name": "' + name + '", "arguments": ' + json.dumps(args) + "}\n</tool_call>"


class ToolUsingModel(ScriptedEngine):
    """Questions are "compute E1 ; E2 ; ..." (or "crash", or "weather"): it calls the calculator on the
    first expression without a result in the prompt, then answers "Results: R1 , R2". When the prompt
    ends inside a call (tool_choice forced it), it writes the rest of that call."""

    def __init__(self, tokenizer):
        super().__init__(tokenizer)
        self.encoded: list[str] = []  # every text the server encoded (prompt + any forced call prefix)
        real = tokenizer.encode

        def encode(text, add_special_tokens=True):
            self.encoded.append(text)
            return real(text, add_special_tokens)

        tokenizer.encode = encode

    def reply(self, prompt: str) -> str:
        question = prompt.split("t2 user ", 1)[1].split(" t3", 1)[0]
        results = TOOL_TURN.findall(prompt)
        if question == "crash":
            return "Tool said: " + results[0] if results else call_text("crash", {})
        if question == "weather":
            return call_text("get_weather", {"city": "Bern"})
        exprs = [e.strip() for e in question.removeprefix("compute ").split(";")]
        if len(results) < len(exprs):
            return call_text("calculator", {"expression": exprs[len(results)]})
        return "Results: " + " , ".join(results)

    def add_request(self, prompt, params, request_id):
        # the prompt as encoded: the rendered chat plus any forced call prefix (other texts the server
        # encodes, e.g. to build an output constraint, do not start with the rendered chat)
        text = next(t for t in reversed(self.encoded) if t.startswith(prompt["prompt"]))
        out = self.reply(text)
        for k in range(len(out), 0, -1):  # a forced call prefix at the prompt's end: continue it
            if text.endswith(out[:k]) and out[:k].startswith("<tool_call>"):
                out = out[k:]
                break
        self.scripts.append([out[i:i + 4] for i in range(0, len(out), 4)])
        return super().add_request(prompt, params, request_id)


class McpServerThread(ServerThread):
    """ServerThread with an MCP hub started in its loop and set on the app before it serves."""

    def __init__(self, llm_engine, settings: McpSettings, **config):  # noqa: D107 - ServerThread's, plus the hub
        config.setdefault("model_names", ["scripted"])

        async def with_hub(app):
            self.hub = await start_hub(settings, announce=False)
            app[MCP_HUB] = self.hub

        super().__init__(llm_engine, before_serving=with_hub, **config)

    def stop(self) -> None:
        try:
            self.call(self.hub.close())
        finally:
            super().stop()


@pytest.fixture
def served(tmp_path):
    made = []

    def make(max_rounds=8):
        d = tmp_path / f"tok{len(made)}"
        d.mkdir()
        write_word_tokenizer(d, 100, eos_id=1)
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        model = ToolUsingModel(Tokenizer.from_pretrained_dir(d))
        settings = McpSettings(tuple(load_mcp_config(write_config(tmp_path))), max_rounds)
        srv = McpServerThread(model, settings, tool_parser="hermes")
        made.append(srv)
        return srv, model

    yield make
    for srv in made:
        srv.stop()


def chat(srv, content, **kw):
    r = post(srv, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": content}],
                                           **kw})
    assert r.status_code == 200, r.text
    return r.json()


def sse(srv, content, **kw) -> tuple[list[dict], list[str]]:
    """(the JSON chunks, every raw data line) of a streamed chat."""
    body = {"model": "scripted", "messages": [{"role": "user", "content": content}], "stream": True, **kw}
    r = requests.post(srv.base_url + "/v1/chat/completions", json=body, stream=True, timeout=60)
    assert r.status_code == 200, r.text
    lines = [ln[len("data: "):] for ln in r.iter_lines(decode_unicode=True) if ln.startswith("data: ")]
    return [json.loads(ln) for ln in lines if ln != "[DONE]"], lines


# -- one and several rounds ----------------------------------------------------------------------
def test_a_chat_gets_the_calculators_answer_through_one_round(served):
    srv, model = served()
    out = chat(srv, "compute 1234*5678")
    msg = out["choices"][0]["message"]
    assert msg["content"] == "Results: 7006652" and out["choices"][0]["finish_reason"] == "stop"
    assert "tool_calls" not in msg
    [rnd] = out["mcp_rounds"]
    [call] = rnd["message"]["tool_calls"]
    assert call["function"]["name"] == "calculator"
    assert json.loads(call["function"]["arguments"]) == {"expression": "1234*5678"}
    assert rnd["tool_results"] == [{"role": "tool", "tool_call_id": call["id"], "name": "calculator",
                                    "content": "7006652", "is_error": False}]
    # round 1's prompt offered the MCP tools; round 2's holds the call and the result the server computed
    assert "t6 calculator echo crash" in model.encoded[0]
    assert "t5 calculator" in model.encoded[1] and "t2 tool 7006652 t3" in model.encoded[1]
    assert out["usage"]["prompt_tokens"] == len(model.prompts[0]) + len(model.prompts[1])
    pieces = [-(-len(t) // 4) for t in (call_text("calculator", {"expression": "1234*5678"}), "Results: 7006652")]
    assert out["usage"]["completion_tokens"] == sum(pieces)  # one token per scripted piece, both rounds


def test_several_rounds_and_the_cap(served):
    srv, model = served(max_rounds=3)
    out = chat(srv, "compute 2+3 ; 6*7 ; 2**10")
    assert out["choices"][0]["message"]["content"] == "Results: 5 , 42 , 1024"
    assert [r["tool_results"][0]["content"] for r in out["mcp_rounds"]] == ["5", "42", "1024"]
    assert len(model.prompts) == 4

    out = chat(srv, "compute 1+1 ; 2+2 ; 3+3 ; 4+4")  # a 4th round of calls is past the cap of 3
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length" and len(out["mcp_rounds"]) == 3
    assert json.loads(choice["message"]["tool_calls"][0]["function"]["arguments"]) == {"expression": "4+4"}


def test_streaming_shows_every_round(served):
    srv, model = served()
    chunks, lines = sse(srv, "compute 12*12 ; 100-1", stream_options={"include_usage": True})
    assert lines.count("[DONE]") == 1 and lines[-1] == "[DONE]"
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    tool_msgs = [d for d in deltas if d.get("role") == "tool"]
    assert [(t["name"], t["content"], t["is_error"]) for t in tool_msgs] == [("calculator", "144", False),
                                                                            ("calculator", "99", False)]
    calls = {}  # merged by index, as OpenAI clients merge them
    for d in deltas:
        for tc in d.get("tool_calls", []):
            c = calls.setdefault(tc["index"], {"id": None, "args": ""})
            c["id"] = tc.get("id") or c["id"]
            c["args"] += tc.get("function", {}).get("arguments") or ""
    assert [json.loads(c["args"]) for _, c in sorted(calls.items())] == [{"expression": "12*12"},
                                                                        {"expression": "100-1"}]
    assert [t["tool_call_id"] for t in tool_msgs] == [c["id"] for _, c in sorted(calls.items())]
    # the results fed back, and the answer built on them, after the last tool chunk
    assert "t2 tool 144 t3" in model.encoded[2] and "t2 tool 99 t3" in model.encoded[2]
    last_tool = max(i for i, d in enumerate(deltas) if d.get("role") == "tool")
    assert "".join(d.get("content") or "" for d in deltas[last_tool + 1:]) == "Results: 144 , 99"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens"] == sum(len(p) for p in model.prompts) and not chunks[-1]["choices"]


def test_a_forced_first_round_then_auto(served):
    srv, model = served()
    out = chat(srv, "compute 7*6", tool_choice={"type": "function", "function": {"name": "calculator"}})
    assert out["choices"][0]["message"]["content"] == "Results: 42"
    first, second = [t for t in model.encoded if t.startswith("t2 user")]  # the two rounds' prompts
    assert first.split("t4", 1)[1].startswith("<tool_call>")  # round 1: the call forced after the prompt
    assert second.endswith("t4")  # round 2 is auto: nothing forced, no constraint
    assert getattr(model.params[1], "structured_outputs", None) is None


# -- what stays as it was ------------------------------------------------------------------------
def test_requests_with_their_own_tools_or_none_skip_mcp(served):
    srv, model = served()
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    out = chat(srv, "weather", tools=tools)
    assert out["choices"][0]["finish_reason"] == "tool_calls" and "mcp_rounds" not in out
    assert "t6 get_weather t4" in model.encoded[-1] and "calculator" not in model.encoded[-1]
    out = chat(srv, "compute 1+1", tool_choice="none")
    assert "t6" not in model.encoded[-1] and "mcp_rounds" not in out


def test_a_call_to_a_tool_that_is_not_mcp_ends_the_rounds(served):
    srv, _ = served()
    out = chat(srv, "weather")
    choice = out["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and out["mcp_rounds"] == []
    assert choice["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_n_above_one_is_refused(served):
    srv, _ = served()
    r = post(srv, "/v1/chat/completions", {"model": "scripted", "messages": [{"role": "user", "content": "x"}],
                                           "n": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# -- a server that dies --------------------------------------------------------------------------
def test_a_crashed_mcp_server_fails_the_call_not_the_server(served):
    srv, _ = served()
    out = chat(srv, "crash")
    [rnd] = out["mcp_rounds"]
    [result] = rnd["tool_results"]
    assert result["is_error"] and "stopped answering" in result["content"]
    assert out["choices"][0]["message"]["content"] == "Tool said: " + result["content"]
    chunks, _ = sse(srv, "compute 3*3")  # the next request: the MCP server is started again
    assert [c["choices"][0]["delta"]["content"] for c in chunks
            if c["choices"] and c["choices"][0]["delta"].get("role") == "tool"] == ["9"]
    assert srv.hub.connections[0].restarts == 1
    assert requests.get(srv.base_url + "/health", timeout=5).status_code == 200


def test_a_tool_error_is_fed_back(served):
    srv, model = served()
    out = chat(srv, "compute 1/0")
    result = out["mcp_rounds"][0]["tool_results"][0]
    assert result["is_error"] and "division by zero" in result["content"]
    assert "division by zero" in model.encoded[1]


# -- mcp.json ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, says", [
    ([], "expected {\"mcpServers\""),
    ({"mcpServers": {}}, "names no (enabled) server"),
    ({"mcpServers": {"a": {"command": "x", "url": "http://h"}}}, "exactly one of 'command'"),
    ({"mcpServers": {"a": {"args": ["x"]}}}, "exactly one of 'command'"),
    ({"mcpServers": {"a": {"command": "x", "args": "y"}}}, "mcpServers.a.args must be an array"),
    ({"mcpServers": {"a": {"url": "ftp://h"}}}, "mcpServers.a.url must be an http"),
    ({"mcpServers": {"a": {"command": "x", "timeout": 0}}}, "mcpServers.a.timeout"),
    ({"mcpServers": {"a b": {"command": "x"}}}, "server name 'a b'"),
    ({"mcpServers": {"a": {"command": "x", "envs": {}}}}, "unknown key(s) envs"),
])
def test_bad_configs_name_the_problem(cfg, says):
    with pytest.raises(McpConfigError) as e:
        parse_mcp_config(cfg, "m.json")
    assert says in str(e.value) and str(e.value).startswith("--mcp-config m.json: ")


def test_good_config_both_transports():
    specs = parse_mcp_config({"mcpServers": {
        "a": {"command": "python", "args": ["s.py"], "env": {"K": "v"}},
        "b": {"url": "http://127.0.0.1:9/mcp", "headers": {"Authorization": "Bearer t"}, "timeout": 5},
        "c": {"command": "off", "disabled": True}}})
    assert [(s.name, s.transport) for s in specs] == [("a", "stdio"), ("b", "http")]
    assert specs[0].args == ("s.py",) and specs[0].env == {"K": "v"} and specs[1].timeout == 5


def test_colliding_tool_names_get_the_server_prefix(tmp_path):
    cfg = {"command": sys.executable, "args": [SERVER_PY], "timeout": 30}
    settings = McpSettings(tuple(parse_mcp_config({"mcpServers": {"one": cfg, "two": cfg}})), 8)

    async def run():
        hub = await start_hub(settings, announce=False)
        try:
            names = [t["function"]["name"] for t in hub.openai_tools]
            result = await hub.call("two_calculator", '{"expression": "2*21"}')
            return names, result
        finally:
            await hub.close()

    names, result = asyncio.run(run())
    assert names == ["one_calculator", "one_echo", "one_crash", "two_calculator", "two_echo", "two_crash"]
    assert (result.content, result.is_error) == ("42", False)


# -- tallow serve --------------------------------------------------------------------------------
def serve_cmd(*flags, code=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    argv = [sys.executable, "-m", "tallow.server", *flags] if code is None else [sys.executable, "-c", code, *flags]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", ["not json", "no server", "missing command", "never answers", "no sdk"])
def test_serve_with_a_broken_mcp_setup_exits_with_one_line(tmp_path, case):
    path = tmp_path / "mcp.json"
    servers = {"calc": {"command": sys.executable, "args": [SERVER_PY]}}
    if case == "missing command":
        servers = {"calc": {"command": "no-such-mcp-server-xyz"}}
    if case == "never answers":
        servers = {"calc": {"command": sys.executable, "args": ["-c", "import time; time.sleep(60)"], "timeout": 1}}
    path.write_text("{mcpServers: " if case == "not json" else json.dumps({"mcpServers": servers}))
    if case == "no server":
        path.write_text(json.dumps({"mcpServers": {"calc": {"command": "x", "disabled": True}}}))
    flags = ["--w", str(tmp_path / "no-model-needed"), "--p", "0", "--mcp-config", str(path)]
    code = None
    if case == "no sdk":  # the SDK hidden from the server
        code = ("import importlib.util as u, sys; real = u.find_spec; "
                "u.find_spec = lambda n, *a: None if n == 'mcp' else real(n, *a); "
                "from tallow.server.cli import main; sys.exit(main(sys.argv[1:]))")
    t = time.monotonic()
    p = serve_cmd(*flags, code=code)
    # one line says what is wrong (a server that fails to start may follow the "loading ..." line)
    lines = [ln for ln in p.stderr.splitlines() if ln.strip() and not ln.startswith("tallow serve: loading ")]
    assert p.returncode == 1, p.stderr
    assert len(lines) == 1 and lines[0].startswith("tallow serve: error: "), p.stderr
    assert "Traceback" not in p.stderr
    expect = {"not json": "not valid JSON", "no server": "names no (enabled) server",
              "missing command": "no-such-mcp-server-xyz", "never answers": "did not start within 1 s",
              "no sdk": "pip install tallow[mcp]"}[case]
    assert expect in lines[0]
    assert time.monotonic() - t < 60


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    kids = {int(x) for x in out.split()}
    for k in list(kids):
        kids |= _children(k)
    return kids


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.parametrize("api_servers", [1, 2])
def test_serve_starts_the_mcp_servers_and_stops_them_on_exit(tmp_path, api_servers):
    """Each API server process starts its own copy of the stdio server; none outlives tallow serve."""
    import socket

    model = write_tiny_llama(tmp_path / "m", seed=3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    p = subprocess.Popen([sys.executable, "-m", "tallow.server", "--w", str(model), "--p", str(port),
                          "--max-model-len", "512", "--api-server-count", str(api_servers),
                          "--mcp-config", write_config(tmp_path)],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t = time.monotonic()
        while True:
            assert p.poll() is None, p.stderr.read()
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            assert time.monotonic() - t < 90, "the server did not come up"
            time.sleep(0.2)
        deadline = time.monotonic() + 60  # an extra API process starts its MCP server after /health answers
        while len(mcp_pids := [k for k in _children(p.pid) if "mcp_test_server.py" in _cmdline(k)]) < api_servers:
            assert time.monotonic() < deadline, mcp_pids
            time.sleep(0.2)
        assert len(mcp_pids) == api_servers
        for _ in range(2 * api_servers):  # connections spread over the processes
            r = requests.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                              json={"messages": [{"role": "user", "content": "t7 t8"}], "max_tokens": 4})
            assert r.status_code == 200 and "mcp_rounds" in r.json()  # the MCP tools were offered
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "MCP server 'calc' (stdio): 3 tool(s): calculator, echo, crash" in err
    deadline = time.monotonic() + 10
    while any(os.path.exists(f"/proc/{k}") and "mcp_test_server.py" in _cmdline(k) for k in mcp_pids):
        assert time.monotonic() < deadline, "the MCP server outlived tallow serve"
        time.sleep(0.1)


def test_a_streamable_http_server_by_url(tmp_path):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, SERVER_PY, "--http", str(port)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert p.poll() is None and time.monotonic() < deadline, "the HTTP MCP server did not come up"
                time.sleep(0.1)
        url = f"http://127.0.0.1:{port}/mcp"
        settings = McpSettings(tuple(parse_mcp_config({"mcpServers": {
            "plain": {"url": url}, "auth": {"url": url, "headers": {"Authorization": "Bearer t"}}}})), 8)

        async def run():
            hub = await start_hub(settings, announce=False)
            try:
                return await hub.call("plain_calculator", {"expression": "3**4"}), \
                    await hub.call("auth_echo", {"text": "over http"})
            finally:
                await hub.close()

        calc, echo = asyncio.run(run())
        assert (calc.content, calc.is_error, echo.content, echo.is_error) == ("81", False, "over http", False)
    finally:
        p.terminate()
        p.wait(10)
