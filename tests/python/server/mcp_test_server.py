"""An MCP server for the tests, over stdio, written with the SDK's MCPServer (FastMCP in mcp 1.x):
a calculator, an echo tool that touches no file, and a tool that ends its own process (to test what
the chat server does when an MCP server dies mid-call).

    python mcp_test_server.py            # speaks MCP on stdin/stdout until stdin closes
    python mcp_test_server.py --http PORT   # streamable HTTP at http://127.0.0.1:PORT/mcp
"""
import ast
import operator
import os

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

app = MCPServer("tallow-test", log_level="ERROR")

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.Pow: operator.pow, ast.Mod: operator.mod, ast.FloorDiv: operator.floordiv, ast.USub: operator.neg,
        ast.UAdd: operator.pos}


def _eval(node):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.left), _eval(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    raise ToolError(f"unsupported expression element {type(node).__name__}")


@app.tool()
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression (+ - * / // % ** and parentheses) and return the number."""
    try:
        value = _eval(ast.parse(expression, mode="eval"))
    except (SyntaxError, ZeroDivisionError) as e:
        raise ToolError(f"cannot evaluate {expression!r}: {e}") from None
    return str(value)


@app.tool()
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@app.tool()
def crash() -> str:
    """End this MCP server's process at once (for tests of a server that dies)."""
    os._exit(3)


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--http"]:  # streamable HTTP on 127.0.0.1:PORT/mcp instead of stdio
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run("stdio")
