"""Config-only model folders of benchmark shapes, and (optionally) the quantized GGUF made from them.

    python benchmarks/make_quant_gguf.py llama3-8b /tmp/llama3-8b                 # the folder only
    python benchmarks/make_quant_gguf.py llama3-8b /tmp/llama3-8b \
        --gguf /tmp/llama3-8b-q4_k_m.gguf --type q4_k_m --device cuda            # and the GGUF
    python benchmarks/make_quant_gguf.py qwen3-0.6b /tmp/qwen3-0.6b --gguf /tmp/qwen3-0.6b-q4_k_m.gguf --device cuda

The folder holds config.json (the shape), tokenizer.model (the Llama-2 SentencePiece model, 32000
pieces, from the test data) and tokenizer_config.json; no weights. `tallow quantize FOLDER OUT.gguf
--type T --load-format dummy` fills the weights with random values on --device and writes the GGUF
(the command this script runs with --gguf). The written vocabulary is the SentencePiece model padded
with unused [PADn] tokens up to the shape's vocab_size (gguf_export's writer does that), so the
embedding and the output head have the real model's size and llama.cpp loads and runs the file. The
text it produces is noise (random weights): these files are for speed, not quality.

Shapes:
- llama3-8b: Llama-3-8B (hidden 4096, 32 layers, 32 heads, 8 KV heads, intermediate 14336, vocab 128256,
  rope theta 500000, untied output); Q4_K_M is about 4.9 GB.
- qwen3-0.6b: Qwen3-0.6B (hidden 1024, 28 layers, 16 heads, 8 KV heads, head_dim 128, intermediate 3072,
  vocab 151936, tied embeddings, q/k norms); Q4_K_M is about 0.5 GB.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SHAPES = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, intermediate_size=3072,
        vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        hidden_act="silu", tie_word_embeddings=True, attention_bias=False, torch_dtype="bfloat16",
        bos_token_id=1, eos_token_id=2),
}

# The Llama-2 tokenizer's special pieces (ids 0, 1, 2 of tokenizer.model).
TOKENIZER_CONFIG = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True,
                    "add_eos_token": False}


def find_spm_tokenizer() -> str:
    """tokenizer.model of the test data: $TALLOW_TEST_DATA, the repo's .gpu_data (carried to a GPU
    machine), or the shared data folder beside the checkout."""
    roots = [os.environ.get("TALLOW_TEST_DATA"), os.path.join(HERE, "..", ".gpu_data"),
             os.path.join(HERE, "..", "..", "shared", "data"), "/work/shared/data"]
    for r in roots:
        if r and os.path.isfile(os.path.join(r, "llama2-tokenizer", "tokenizer.model")):
            return os.path.abspath(os.path.join(r, "llama2-tokenizer", "tokenizer.model"))
    raise SystemExit("make_quant_gguf: no llama2-tokenizer/tokenizer.model in $TALLOW_TEST_DATA, .gpu_data or "
                     "the shared data folder (pass --tokenizer PATH)")


def write_folder(shape: str, folder: str, tokenizer: str | None, overrides: dict | None = None) -> str:
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({**SHAPES[shape], **(overrides or {})}, f, indent=2)
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2)
    shutil.copyfile(tokenizer or find_spm_tokenizer(), os.path.join(folder, "tokenizer.model"))
    return folder


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("folder", help="the config-only model folder to write")
    ap.add_argument("--tokenizer", default=None, help="a SentencePiece tokenizer.model (default: the test data's)")
    ap.add_argument("--gguf", default=None, help="also run `tallow quantize` into this GGUF")
    ap.add_argument("--type", default="q4_k_m", help="quantization type for --gguf (default q4_k_m)")
    ap.add_argument("--device", default="cpu", help="where tallow quantize makes and quantizes the weights")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config.json entry (a JSON value), e.g. --set num_hidden_layers=2 for a quick try")
    args = ap.parse_args(argv)
    overrides = {}
    for kv in args.set:
        key, sep, value = kv.partition("=")
        if not sep:
            ap.error(f"--set takes KEY=VALUE, got {kv!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    write_folder(args.shape, args.folder, args.tokenizer, overrides)
    print(f"wrote {args.folder} ({args.shape}: config.json, tokenizer.model, tokenizer_config.json)")
    if args.gguf:
        cmd = [sys.executable, "-m", "tallow.cli", "quantize", args.folder, args.gguf, "--type", args.type,
               "--load-format", "dummy", "--device", args.device, "--seed", str(args.seed), "--name", args.shape]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.call(cmd)
        if rc != 0:
            return rc
        print(f"wrote {args.gguf} ({os.path.getsize(args.gguf) / 2**30:.2f} GiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
