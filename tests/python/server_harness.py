"""Shared by the server tests: a tiny random Llama written with numpy (no torch needed), a live
server on 127.0.0.1 in a background thread, and a scripted engine whose output text is fixed."""
from __future__ import annotations

import asyncio
import json
import pathlib
import threading
import time
from typing import Optional

import numpy as np

from engine_models import write_word_tokenizer

CHAT_TEMPLATE = ("{% for m in messages %}t2 {{ m['role'] }} {{ m['content'] or '' }}"
                 "{% if m.tool_calls %}{% for c in m.tool_calls %} t5 {{ c.function.name }} "
                 "{{ c.function.arguments | tojson }}{% endfor %}{% endif %} t3 {% endfor %}"
                 "{% if tools %}t6 {% for t in tools %}{{ t.function.name }} {% endfor %}{% endif %}"
                 "{% if add_generation_prompt %}t4{% endif %}")

LLAMA_CFG = dict(vocab_size=320, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                 tie_word_embeddings=False, eos_token_id=1, bos_token_id=None, rope_theta=10000.0)


def write_tiny_llama(path: pathlib.Path, seed: int = 0, chat_template: Optional[str] = CHAT_TEMPLATE,
                     **overrides) -> pathlib.Path:
    """config.json + model.safetensors (random f32 weights) + a WordLevel tokenizer ("t0".."tN")."""
    from safetensors.numpy import save_file

    cfg = dict(LLAMA_CFG, **overrides)
    rng = np.random.default_rng(seed)
    h, v, inter, d = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def w(*shape, scale=0.08):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    t = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float32), "lm_head.weight": w(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        t[p + "self_attn.q_proj.weight"] = w(nh * d, h)
        t[p + "self_attn.k_proj.weight"] = w(nkv * d, h)
        t[p + "self_attn.v_proj.weight"] = w(nkv * d, h)
        t[p + "self_attn.o_proj.weight"] = w(h, nh * d)
        t[p + "mlp.gate_proj.weight"] = w(inter, h)
        t[p + "mlp.up_proj.weight"] = w(inter, h)
        t[p + "mlp.down_proj.weight"] = w(h, inter)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                  "torch_dtype": "float32", **cfg}))
    write_word_tokenizer(path, v, eos_id=cfg["eos_token_id"])
    if chat_template is not None:
        tc = json.loads((path / "tokenizer_config.json").read_text())
        tc["chat_template"] = chat_template
        (path / "tokenizer_config.json").write_text(json.dumps(tc))
    return path


class ServerThread:
    """An AsyncEngine + aiohttp app on 127.0.0.1 (a free port) in a background event loop."""

    def __init__(self, llm_engine, *, before_serving=None, **config):
        """before_serving: an async callable given the app after it is built, before it listens."""
        from tallow.engine.async_engine import AsyncEngine
        from tallow.server.app import ServerConfig, build_app, start_server

        config.setdefault("model_names", ["tiny"])
        self.config = ServerConfig(**config)
        self.llm_engine = llm_engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

        async def setup():
            self.engine = AsyncEngine(llm_engine)
            self.app = build_app(self.engine, self.config)
            if before_serving is not None:
                await before_serving(self.app)
            self.runner, self.port = await start_server(self.app, "127.0.0.1", 0)

        self.call(setup())
        self.base_url = f"http://127.0.0.1:{self.port}"

    def call(self, coro, timeout: float = 60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def in_engine(self, fn, timeout: float = 60):
        """fn(llm_engine) run on the step thread between steps."""
        return self.call(self.engine.run_in_engine(fn), timeout)

    def pool_state(self) -> tuple[int, int]:
        return self.in_engine(lambda e: (e.kv.num_free_blocks, e.kv.pool.num_blocks))

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Wait until the engine holds no request and every KV block is free."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            busy = self.in_engine(lambda e: (e.has_unfinished_requests(),
                                             getattr(e, "kv", None) and e.kv.num_free_blocks != e.kv.pool.num_blocks))
            if not any(busy):
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"engine still busy after {timeout}s: {busy}")
            time.sleep(0.02)

    def stop(self) -> None:
        async def teardown():
            await self.runner.cleanup()
            await self.engine.shutdown()

        try:
            self.call(teardown())
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


# -- a scripted engine -------------------------------------------------------------------------
class ScriptedEngine:
    """The LLMEngine interface the AsyncEngine uses, producing scripted texts: each request takes
    the next script (a list of text pieces, one piece per step and per token) from ``scripts``, or
    repeats ``default``. Tests of tool calling and reasoning drive the server with it."""

    def __init__(self, tokenizer, max_model_len: int = 4096):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scripts: list[list[str]] = []
        self.default = ["Hello", " world", "!"]
        self.groups: dict = {}
        self.prompts: list[list[int]] = []
        self.params: list = []
        self.stats = {"prompt_tokens": 0, "generation_tokens": 0, "steps": 0}
        self.fail_next_step = False

    def add_request(self, prompt, params, request_id):
        from tallow.engine.sampling_params import SamplingParams

        params = params or SamplingParams()
        params.validate()
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else self.tokenizer.encode(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError("the prompt is too long")
        script = self.scripts.pop(0) if self.scripts else self.default
        # a tuple holds one script per choice (n > 1); a list is every choice's script
        per_choice = [list(script[i % len(script)]) for i in range(params.n)] if isinstance(script, tuple) \
            else [list(script)] * params.n
        self.prompts.append(list(ids))
        self.params.append(params)
        self.groups[request_id] = {"ids": ids, "n": params.n, "script": per_choice, "pos": [0] * params.n,
                                   "done": [False] * params.n, "params": params}
        self.stats["prompt_tokens"] += len(ids)
        return request_id

    def abort_request(self, request_id):
        self.groups.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.groups)

    def step(self):
        from tallow.engine.outputs import CompletionOutput, Logprob, RequestOutput

        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("scripted failure")
        self.stats["steps"] += 1
        outs = []
        for rid, g in list(self.groups.items()):
            comps = []
            for i in range(g["n"]):
                if g["done"][i]:  # like the engine: a finished sequence keeps reporting its reason
                    comps.append(CompletionOutput(i, "", [], finish_reason=g["done"][i]))
                    continue
                piece = g["script"][i][g["pos"][i]]
                g["pos"][i] += 1
                max_tokens = g["params"].max_tokens
                finish = None
                if g["pos"][i] >= len(g["script"][i]):
                    finish = "stop"
                elif max_tokens is not None and g["pos"][i] >= max_tokens:
                    finish = "length"
                g["done"][i] = finish or False
                lps = None
                if g["params"].logprobs is not None:
                    lps = [{7: Logprob(-0.5, rank=1, decoded_token=piece)}]
                comps.append(CompletionOutput(i, piece, [7], None, lps, finish))
                self.stats["generation_tokens"] += 1
            finished = all(g["done"])
            outs.append(RequestOutput(rid, None, g["ids"], comps, finished, 0, delta=True))
            if finished:
                del self.groups[rid]
        return outs


def post(srv, path, body=None, data=None, headers=None, timeout=30):
    """POST a JSON body (or raw data) to a ServerThread or any object with base_url."""
    import requests

    return requests.post(srv.base_url + path, json=body if data is None else None, data=data, headers=headers,
                         timeout=timeout)


async def collect(stream):
    """Drain a request's stream of delta RequestOutputs: (text, token ids, finish reason) per
    completion index."""
    text, ids, finish = {}, {}, {}
    async for out in stream:
        assert out.delta
        for o in out.outputs:
            text[o.index] = text.get(o.index, "") + o.text
            ids.setdefault(o.index, []).extend(o.token_ids)
            if o.finish_reason:
                finish[o.index] = o.finish_reason
    return text, ids, finish


# -- a server on a scripted engine, recording the texts it encodes (tool-call and Responses tests) ----------
def pieces(text: str, size: int = 3) -> list[str]:
    """Cut text into small token-like pieces."""
    return [text[i:i + size] for i in range(0, len(text), size)]


def make_tokenizer(tmp_path, template: str):
    """A word tokenizer of 100 words (t0 t1 ...) with this chat template."""
    from tallow.tokenizer import Tokenizer

    d = tmp_path / "tok"
    d.mkdir(parents=True, exist_ok=True)
    write_word_tokenizer(d, 100, eos_id=1)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return Tokenizer.from_pretrained_dir(d)


class Scripted:
    """A scripted server plus a record of the texts the server encoded."""

    def __init__(self, tmp_path, template=CHAT_TEMPLATE, structured_output: bool = False, **config):
        """structured_output: the engine says it honours constraints (it only records them), so forced
        tool calls get their grammar."""
        import openai

        self.tok = make_tokenizer(tmp_path, template)
        self.encoded: list[str] = []
        real = self.tok.encode

        def encode(text, add_special_tokens=True):
            self.encoded.append(text)
            return real(text, add_special_tokens)

        self.tok.encode = encode
        self.engine = ScriptedEngine(self.tok)
        self.engine.structured_output = structured_output
        config.setdefault("model_names", ["scripted"])
        self.srv = ServerThread(self.engine, **config)
        self.client = openai.OpenAI(base_url=self.srv.base_url + "/v1", api_key="x", max_retries=0, timeout=30)

    def prompt(self) -> str:
        """The last rendered prompt encoded (a grammar's compilation encodes other texts after it)."""
        return next(t for t in reversed(self.encoded) if t.startswith("t2 "))

    def script(self, *texts):
        """Each text is cut into pieces; a list is taken as pieces; a tuple holds one per choice."""
        self.engine.scripts.extend(pieces(t) if isinstance(t, str) else t if isinstance(t, tuple) else list(t)
                                   for t in texts)

    def stop(self):
        self.srv.stop()


def disconnect_mid_stream(server, path: str, body: dict, after_events: int) -> None:
    """Stream body to path, read after_events SSE data lines, then close the connection mid-stream; returns
    once the server is idle again, and checks that the request stopped early (its 480-token budget never
    ran out) and that every KV block is back in the pool."""
    import aiohttp

    before = server.in_engine(lambda e: e.stats["generation_tokens"])

    async def main():
        async with aiohttp.ClientSession() as s:
            async with s.post(server.base_url + path, json=body) as r:
                n = 0
                async for line in r.content:
                    if line.startswith(b"data: "):
                        n += 1
                        if n == after_events:
                            break  # leaving the block closes the connection mid-stream

    asyncio.run(main())
    server.wait_idle(timeout=10)
    assert server.in_engine(lambda e: e.stats["generation_tokens"]) - before < 200  # aborted long before its end
    free, total = server.pool_state()
    assert free == total


def kill_mid_stream(url: str, pid: int, timeout: float = 30) -> None:
    """Start a 1000-token completion stream at url, SIGKILL process pid once 3 chunks have come, and check
    that the stream ends at once with an error event instead of hanging or running to its end."""
    import os
    import signal

    import requests

    got, ends = [], []

    def stream():
        with requests.post(url + "/v1/completions", json={"prompt": "t5", "max_tokens": 1000, "ignore_eos": True,
                                                          "stream": True}, stream=True, timeout=30) as resp:
            for line in resp.iter_lines():
                if line.startswith(b"data: {"):
                    got.append(line)
        ends.append(got[-1] if got else None)

    th = threading.Thread(target=stream)
    th.start()
    t = time.monotonic()
    while len(got) < 3:
        assert time.monotonic() - t < timeout, "the stream did not start"
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    th.join(timeout)
    assert not th.is_alive(), "the in-flight stream hung"
    assert len(got) < 1000 and b'"error"' in ends[0], ends  # it ended with an error event, not 1000 tokens
