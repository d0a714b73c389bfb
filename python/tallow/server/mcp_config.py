"""`--mcp-config mcp.json`: the MCP servers whose tools the chat endpoint offers and runs.

The format candle-vllm, vLLM.rs and Claude Desktop read::

    {"mcpServers": {
        "calc":   {"command": "python", "args": ["calc_server.py"], "env": {"KEY": "value"}},
        "search": {"url": "http://127.0.0.1:9000/mcp", "headers": {"Authorization": "Bearer ..."}}}}

A server is started by ``command`` (stdio) or reached at ``url`` (streamable HTTP), never both.
tallow also reads ``cwd`` (stdio), ``timeout`` (seconds to start, and per tool call; default 60) and
``disabled`` (true: skip it). Everything here is checked before the model loads, so a broken file
costs one line on stderr, not a model load."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

DEFAULT_TIMEOUT_S = 60.0
_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")  # an MCP server name becomes a tool-name prefix on collisions


class McpConfigError(ValueError):
    """mcp.json cannot be used; the message names the file and the entry."""


class McpStartError(RuntimeError):
    """An MCP server could not be started or listed (or the SDK is missing); one line for the user."""


@dataclasses.dataclass(frozen=True)
class McpServerSpec:
    name: str
    command: Optional[str] = None  # stdio
    args: tuple[str, ...] = ()
    env: Optional[dict] = None
    cwd: Optional[str] = None
    url: Optional[str] = None  # streamable HTTP
    headers: Optional[dict] = None
    timeout: float = DEFAULT_TIMEOUT_S

    @property
    def transport(self) -> str:
        return "stdio" if self.command else "http"


def load_mcp_config(path: str) -> list[McpServerSpec]:
    """The enabled servers of an mcp.json file, in file order."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise McpConfigError(f"--mcp-config {path}: cannot read it: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise McpConfigError(f"--mcp-config {path}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}"
                             ) from None
    return parse_mcp_config(data, path)


def parse_mcp_config(data, where: str = "mcp.json") -> list[McpServerSpec]:
    def fail(msg: str):
        raise McpConfigError(f"--mcp-config {where}: {msg}")

    if not isinstance(data, dict) or not isinstance(data.get("mcpServers"), dict):
        fail('expected {"mcpServers": {"name": {"command": ..., "args": [...]} or {"url": ...}}}')
    specs = []
    for name, entry in data["mcpServers"].items():
        at = f"mcpServers.{name}"
        if not _NAME_RE.match(name):
            fail(f"server name {name[:80]!r} must be 1-64 letters, digits, _ . : or -")
        if not isinstance(entry, dict):
            fail(f"{at} must be an object with 'command' or 'url'")
        if entry.get("disabled") is True:
            continue
        unknown = set(entry) - {"command", "args", "env", "cwd", "url", "headers", "timeout", "disabled", "type",
                                "transport", "description"}
        if unknown:
            fail(f"{at} has unknown key(s) {', '.join(sorted(unknown))}")
        command, url = entry.get("command"), entry.get("url")
        if (command is None) == (url is None):
            fail(f"{at} needs exactly one of 'command' (a stdio server) or 'url' (a streamable HTTP server)")
        timeout = entry.get("timeout", DEFAULT_TIMEOUT_S)
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 3600:
            fail(f"{at}.timeout must be a number of seconds in (0, 3600]")
        if command is not None:
            if not isinstance(command, str) or not command.strip():
                fail(f"{at}.command must be a non-empty string")
            args = entry.get("args", [])
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                fail(f"{at}.args must be an array of strings")
            env = entry.get("env")
            if env is not None and (not isinstance(env, dict)
                                    or not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
                fail(f"{at}.env must be an object of strings")
            cwd = entry.get("cwd")
            if cwd is not None and (not isinstance(cwd, str) or not os.path.isdir(cwd)):
                fail(f"{at}.cwd must name an existing folder")
            if entry.get("headers") is not None:
                fail(f"{at}.headers is for 'url' servers")
            specs.append(McpServerSpec(name, command=command, args=tuple(args), env=env, cwd=cwd,
                                       timeout=float(timeout)))
        else:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                fail(f"{at}.url must be an http:// or https:// URL")
            headers = entry.get("headers")
            if headers is not None and (not isinstance(headers, dict)
                                        or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in headers.items())):
                fail(f"{at}.headers must be an object of strings")
            for key in ("args", "env", "cwd"):
                if entry.get(key) is not None:
                    fail(f"{at}.{key} is for 'command' servers")
            specs.append(McpServerSpec(name, url=url, headers=headers, timeout=float(timeout)))
    if not specs:
        fail("names no (enabled) server in 'mcpServers'")
    return specs


INSTALL_HINT = "--mcp-config needs the MCP Python SDK: pip install tallow[mcp]"


@dataclasses.dataclass(frozen=True)
class McpSettings:
    """--mcp-config and --mcp-max-rounds, as every API server process receives them."""
    servers: tuple[McpServerSpec, ...]
    max_rounds: int = 8


def mcp_settings(path: Optional[str], max_rounds: int) -> Optional[McpSettings]:
    """The flags checked before the model loads: the file parses, the SDK is installed."""
    if not path:
        return None
    if max_rounds < 1:
        raise McpConfigError(f"--mcp-max-rounds must be >= 1, got {max_rounds}")
    specs = load_mcp_config(path)
    import importlib.util

    if importlib.util.find_spec("mcp") is None:
        raise McpStartError(INSTALL_HINT)
    return McpSettings(tuple(specs), max_rounds)
