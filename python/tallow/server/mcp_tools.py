"""The MCP servers of `--mcp-config`, spoken to through the `mcp` SDK (stdio and streamable HTTP).

    hub = McpHub(load_mcp_config("mcp.json"), max_rounds=8)
    await hub.start()                         # every server started and listed, or McpStartError
    hub.openai_tools                          # their tools as OpenAI function tools
    result = await hub.call("calculator", '{"expression": "6*7"}')   # ToolResult("42", is_error=False)
    await hub.close()                         # stdio servers stopped

Each API server process (--api-server-count) holds its own hub, and so its own copy of each stdio
server. A tool keeps the name its server gives it; when two servers offer the same name, both are
offered as ``<server>_<tool>`` (as vLLM.rs names them). A call never raises: a server that died,
hung past its timeout or refused the call gives a ToolResult with is_error set and a message for the
model, and a server whose connection failed is started again for the next call.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import sys
from typing import Any, Optional

from aiohttp import web

from tallow.server.errors import bad_request
from tallow.server.mcp_config import INSTALL_HINT, McpServerSpec, McpSettings, McpStartError

log = logging.getLogger("tallow.server.mcp")

_TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")  # what protocol.chat_tools accepts
_MAX_RESULT_CHARS = 100_000  # a tool result goes back into the prompt: bounded like a message


@dataclasses.dataclass
class ToolResult:
    content: str
    is_error: bool = False


def require_sdk() -> None:
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise McpStartError(INSTALL_HINT) from None


def _leaf(e: BaseException) -> BaseException:
    while isinstance(e, BaseExceptionGroup) and e.exceptions:  # anyio wraps transport errors in groups
        e = e.exceptions[0]
    return e


def _one_line(e: BaseException) -> str:
    e = _leaf(e)
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _connection_failed(e: BaseException) -> bool:
    """The server is gone or stuck (restart it), as opposed to a refusal it answered with."""
    from mcp import MCPError
    from mcp_types import CONNECTION_CLOSED, REQUEST_TIMEOUT

    if isinstance(e, MCPError):
        return e.code in (CONNECTION_CLOSED, REQUEST_TIMEOUT)
    return True


def result_text(result) -> str:
    """A CallToolResult as the text of a tool message: its text parts, other parts named, else the
    structured content as JSON."""
    parts = []
    for c in result.content or ():
        kind = getattr(c, "type", "")
        if kind == "text":
            parts.append(c.text)
        elif kind == "resource" and getattr(c.resource, "text", None) is not None:
            parts.append(c.resource.text)
        else:
            parts.append(f"[{kind or 'content'}{' ' + c.mime_type if getattr(c, 'mime_type', None) else ''}]")
    text = "\n".join(parts)
    if not text and result.structured_content is not None:
        text = json.dumps(result.structured_content, ensure_ascii=False)
    if len(text) > _MAX_RESULT_CHARS:
        text = text[:_MAX_RESULT_CHARS] + f"... [cut at {_MAX_RESULT_CHARS} characters]"
    return text


class _Connection:
    """One MCP server. The SDK's client is entered and left by one task of its own (anyio's cancel
    scopes must be left by the task that entered them); calls come from the request handlers."""

    def __init__(self, spec: McpServerSpec):
        self.spec = spec
        self.client = None
        self.tools: list = []  # mcp Tool objects of the first listing
        self._owner: Optional[asyncio.Task] = None
        self._stop: Optional[asyncio.Event] = None
        self._lock = asyncio.Lock()
        self.restarts = 0

    def _target(self):
        from mcp import StdioServerParameters
        from mcp.client.streamable_http import streamable_http_client

        s = self.spec
        if s.command:
            return StdioServerParameters(command=s.command, args=list(s.args), env=s.env, cwd=s.cwd)
        if s.headers:
            from mcp.shared._httpx_utils import create_mcp_http_client

            return streamable_http_client(s.url, http_client=create_mcp_http_client(headers=s.headers))
        return s.url

    async def _own(self, ready: asyncio.Future, stop: asyncio.Event) -> None:
        from mcp import Client
        from mcp_types import Implementation

        try:
            async with Client(self._target(), read_timeout_seconds=self.spec.timeout,
                              client_info=Implementation(name="tallow", version="1")) as client:
                tools, cursor = [], None
                for _ in range(100):  # pages; a listing that never ends is cut
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if cursor is None:
                        break
                ready.set_result((client, tools))
                await stop.wait()
        except BaseException as e:  # noqa: BLE001 - handed to start(), or logged once running
            if not ready.done():
                ready.set_exception(e if isinstance(e, Exception) else McpStartError("cancelled"))
            elif not isinstance(e, asyncio.CancelledError):
                log.warning("MCP server %r stopped: %s", self.spec.name, _one_line(e))
            if not isinstance(e, Exception):
                raise

    async def start(self) -> None:
        """Start (or restart) the server and list its tools within its timeout."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future = loop.create_future()
        ready.add_done_callback(lambda f: f.cancelled() or f.exception())  # read even when start() gave up
        self._stop = asyncio.Event()
        self._owner = asyncio.ensure_future(self._own(ready, self._stop))
        try:
            self.client, tools = await asyncio.wait_for(asyncio.shield(ready), self.spec.timeout)
        except asyncio.TimeoutError:
            await self.stop(cancel=True)
            raise McpStartError(f"MCP server {self.spec.name!r} did not start within {self.spec.timeout:g} s "
                                "(its 'timeout' in the config)") from None
        except asyncio.CancelledError:
            await self.stop(cancel=True)
            raise
        except Exception as e:  # noqa: BLE001 - the SDK raises many kinds; the user gets one line
            await self.stop(cancel=True)
            why = _one_line(e)
            if isinstance(_leaf(e), OSError) and self.spec.command:
                why = f"cannot run {self.spec.command!r}: {_leaf(e).strerror or why}"
            raise McpStartError(f"MCP server {self.spec.name!r} failed to start: {why}") from None
        if not self.tools:
            self.tools = tools

    async def stop(self, cancel: bool = False) -> None:
        """Leave the client (a stdio server is stopped); cancel: it is still starting, do not wait for it."""
        owner, self._owner, self.client = self._owner, None, None
        if owner is None:
            return
        self._stop.set()
        if cancel:
            owner.cancel()
        try:  # the SDK stops a stdio server within a few seconds (stdin closed, SIGTERM, SIGKILL)
            await asyncio.wait_for(asyncio.shield(owner), 10)
        except asyncio.TimeoutError:
            owner.cancel()
        except BaseException:  # noqa: BLE001 - it already logged why it stopped
            pass

    async def call(self, tool: str, arguments: dict) -> ToolResult:
        async with self._lock:  # one restart at a time; calls themselves run side by side
            if self.client is None:
                try:
                    self.restarts += 1
                    log.warning("restarting MCP server %r", self.spec.name)
                    await self.start()
                except McpStartError as e:
                    return ToolResult(f"Error: the tool {tool!r} is unavailable: {e}", True)
            client = self.client
        try:
            result = await client.call_tool(tool, arguments, read_timeout_seconds=self.spec.timeout)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the model is told, the server stays up
            why = _one_line(e)
            if _connection_failed(e):
                log.warning("MCP server %r failed calling %r: %s; it will be restarted", self.spec.name, tool, why)
                async with self._lock:
                    if self.client is client:
                        await self.stop()
                return ToolResult(f"Error: the tool {tool!r} failed: MCP server {self.spec.name!r} stopped "
                                  f"answering ({why})", True)
            return ToolResult(f"Error: the tool {tool!r} failed: {why}", True)
        text = result_text(result)
        if result.is_error and not text.lower().startswith("error"):
            text = "Error: " + text
        return ToolResult(text, bool(result.is_error))


class McpHub:
    """Every configured MCP server and the tools they offer under unique names."""

    def __init__(self, specs: list[McpServerSpec], max_rounds: int = 8):
        self.connections = [_Connection(s) for s in specs]
        self.max_rounds = max_rounds
        self.openai_tools: list[dict] = []
        self._route: dict[str, tuple[_Connection, str]] = {}  # offered name -> (server, its own name)

    async def start(self) -> None:
        require_sdk()
        results = await asyncio.gather(*(c.start() for c in self.connections), return_exceptions=True)
        failed = next((r for r in results if isinstance(r, BaseException)), None)
        if failed is not None:
            await self.close()
            raise failed if isinstance(failed, McpStartError) else McpStartError(_one_line(failed))
        try:
            self._name_tools()
        except McpStartError:
            await self.close()
            raise

    def _name_tools(self) -> None:
        owners: dict[str, list[_Connection]] = {}
        for c in self.connections:
            for t in c.tools:
                owners.setdefault(t.name, []).append(c)
        for c in self.connections:
            for t in c.tools:
                name = t.name if len(owners[t.name]) == 1 else f"{c.spec.name}_{t.name}"
                if not _TOOL_NAME_RE.match(name):
                    name = re.sub(r"[^A-Za-z0-9_.:-]", "_", name)[:128]
                if name in self._route:
                    other = self._route[name][0].spec.name
                    raise McpStartError(f"MCP servers {other!r} and {c.spec.name!r} both offer a tool named "
                                        f"{name!r}; rename one of the servers in the config")
                self._route[name] = (c, t.name)
                params = t.input_schema if isinstance(t.input_schema, dict) else {"type": "object", "properties": {}}
                self.openai_tools.append({"type": "function", "function": {
                    "name": name, "description": t.description or t.title or "", "parameters": params}})

    def describe(self) -> list[str]:
        """One line per server for the start-up log."""
        lines = []
        for c in self.connections:
            names = [n for n, (owner, _) in self._route.items() if owner is c]
            lines.append(f"MCP server {c.spec.name!r} ({c.spec.transport}): {len(names)} tool(s)"
                         + (f": {', '.join(names)}" if names else ""))
        return lines

    def owns(self, name: str) -> bool:
        return name in self._route

    async def call(self, name: str, arguments: Any) -> ToolResult:
        """Run one call (arguments as the model wrote them: a JSON string or an object)."""
        conn, tool = self._route[name]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return ToolResult(f"Error: the arguments of {name!r} are not valid JSON: {e.msg}", True)
        if not isinstance(arguments, dict):
            return ToolResult(f"Error: the arguments of {name!r} must be a JSON object", True)
        return await conn.call(tool, arguments)

    async def close(self) -> None:
        await asyncio.gather(*(c.stop() for c in self.connections), return_exceptions=True)


# the hub of an app (absent without --mcp-config); set before the app starts
MCP_HUB = web.AppKey("tallow_mcp_hub", McpHub)


def mcp_hub(app: web.Application) -> Optional[McpHub]:
    return app.get(MCP_HUB)


def offer_mcp_tools(body: dict, hub: Optional[McpHub]) -> tuple[dict, Optional[McpHub]]:
    """(body, hub): the body with the MCP tools added when the request brings none, and the hub when
    the rounds apply to it (else None)."""
    if hub is None or not hub.openai_tools or body.get("tools") is not None or body.get("functions") is not None:
        return body, None
    if body.get("tool_choice") == "none":
        return body, None
    n = body.get("n")
    if isinstance(n, int) and not isinstance(n, bool) and n > 1:
        raise bad_request("'n' > 1 cannot run this server's MCP tools: send n=1, or tool_choice 'none' to "
                          "generate without them", "n")
    return {**body, "tools": hub.openai_tools}, hub


async def start_hub(settings: McpSettings, announce: bool = True) -> McpHub:
    """Every server started and listed (one line each on stderr), or McpStartError."""
    hub = McpHub(list(settings.servers), settings.max_rounds)
    await hub.start()
    if announce:
        for line in hub.describe():
            print(f"tallow serve: {line}", file=sys.stderr, flush=True)
    return hub
