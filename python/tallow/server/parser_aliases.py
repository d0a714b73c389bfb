"""The names candle-vllm and vLLM give their tool-call and reasoning parsers, mapped onto tallow's, so a
copied `--enforce-parser qwen_coder` or `--tool-call-parser hermes --reasoning-parser qwen3` works.

A name that names a format tallow does not parse (vLLM's `pythonic`, candle-vllm's `glm47_moe`, ...) is
refused with one line listing the accepted names: silently falling back to another format would
return tool calls as plain text.
"""
from __future__ import annotations

# other servers' tool-parser name -> tallow's (server/tool_parsers.py PARSERS)
TOOL_PARSER_ALIASES = {
    # candle-vllm (--enforce-parser): qwen / qwen_json are <tool_call>{json}</tool_call>, qwen_xml /
    # qwen_coder the <function=...><parameter=...> format of Qwen3-Coder and Qwen3.5+
    "qwen_json": "hermes", "qwen_xml": "qwen3_coder", "qwen_coder": "qwen3_coder",
    # vLLM (--tool-call-parser): Llama 4 writes Llama 3's JSON; qwen3_xml is qwen3_coder's format;
    # xLAM answers with a JSON array of {"name", "arguments"} objects
    "llama4_json": "llama3_json", "qwen3_xml": "qwen3_coder", "xlam": "json",
}

# tallow's reasoning modes (server/app.py ServerConfig.reasoning): auto (when the chat template speaks
# of <think>), think (always split <think>...</think>), none
REASONING_MODES = ("auto", "think", "none")
# vLLM's --reasoning-parser names whose models write <think>...</think> (an opened <think> at the end
# of the prompt, as DeepSeek-R1's template leaves it, is detected per request: server/reasoning.py)
REASONING_PARSER_ALIASES = {name: "think" for name in (
    "deepseek_r1", "deepseek_v3", "deepseek_v31", "qwen3", "glm45", "kimi_k2")}


def tool_parser_names() -> list[str]:
    """Every name --enforce-parser / --tool-call-parser accepts: tallow's parsers, then the aliases."""
    from tallow.server.tool_parsers import parser_names

    own = parser_names()
    return own + [a for a, target in TOOL_PARSER_ALIASES.items() if target in own and a not in own]


def tool_parser(name: str) -> str:
    """tallow's parser for a tool-parser name of tallow, candle-vllm or vLLM; ValueError (one line
    listing the accepted names) for any other."""
    from tallow.server.tool_parsers import parser_names

    own = parser_names()
    key = name.strip()
    if key in own:
        return key
    target = TOOL_PARSER_ALIASES.get(key)
    if target in own:
        return target
    raise ValueError(f"invalid choice: {name!r}: tallow parses no such tool-call format; accepted: "
                     f"{', '.join(tool_parser_names())}")


def reasoning_mode(name: str) -> str:
    """tallow's reasoning mode for a --reasoning-parser value (tallow's mode or vLLM's parser name)."""
    key = name.strip()
    if key in REASONING_MODES:
        return key
    if key in REASONING_PARSER_ALIASES:
        return REASONING_PARSER_ALIASES[key]
    raise ValueError(f"invalid choice: {name!r}: tallow splits only <think>...</think> reasoning; accepted: "
                     f"{', '.join(REASONING_MODES + tuple(REASONING_PARSER_ALIASES))}")
