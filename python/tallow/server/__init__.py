"""tallow's OpenAI-compatible HTTP server (aiohttp): protocol, SSE streaming, tool-call and
reasoning parsers, metrics and a web UI. It holds no model logic: it talks to an engine client
(engine/core_client.py, the engine core in its own process; or an in-process AsyncEngine).

    from tallow.server import ServerConfig, build_app
"""
from tallow.server.app import ServerConfig, build_app, start_server

__all__ = ["ServerConfig", "build_app", "start_server"]
