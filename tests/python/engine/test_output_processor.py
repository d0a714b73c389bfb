"""OutputProcessor (engine/output_processor.py) on a byte-level BPE vocabulary, a token at a time as the
engine core sends them: a plain sequence (no stop strings, no log-probs: the per-token fast path) streams
exactly the text of the whole output, as do sequences that take the full path (stop strings that never
match, log-probs); a stop string cuts the text and reports the request to the core."""
import pytest

from tallow.engine.engine import make_request_group
from tallow.engine.output_processor import OutputProcessor
from tallow.engine.sampling_params import SamplingParams

TEXT = "Na\u00efve caf\u00e9 \u2014 \u65e5\u672c\u8a9e and emoji \U0001f642\U0001f680 end. " * 3


@pytest.fixture(scope="module")
def tok():
    from tallow.server.demo_model import DemoModelError, demo_model_path

    try:
        path = demo_model_path(download=False)
    except DemoModelError as e:
        pytest.skip(f"needs the demo model's byte-level BPE tokenizer: {e}")
    from tallow.engine.args import EngineArgs
    from tallow.engine.core import load_model_source

    return load_model_source(EngineArgs(model=path))[2]


def stream(op, ids, rids):
    """Feed ids one per step to every request; returns ({rid: text}, {rid: token ids}, {rid: finish},
    stopped ids)."""
    text, got, finish, stopped = {}, {}, {}, []
    live = list(rids)
    for k, t in enumerate(ids):
        last = k == len(ids) - 1
        outs, st = op.process([(r, t, (-0.5, 1, None), "length" if last else None, None, k + 1, 0) for r in live])
        stopped += st
        live = [r for r in live if r not in st]
        for out in outs:
            o = out.outputs[0]
            text[out.request_id] = text.get(out.request_id, "") + o.text
            got.setdefault(out.request_id, []).extend(o.token_ids)
            if o.finish_reason:
                finish[out.request_id] = o.finish_reason
    return text, got, finish, stopped


def add(op, rid, **kw):
    group, _, seqs = make_request_group(rid, "p", [1, 2, 3], SamplingParams(max_tokens=500, **kw))
    op.add_request(group, seqs)
    return group


def test_plain_and_full_paths_stream_the_same_text(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    op = OutputProcessor(tok)
    plain = add(op, "plain")
    add(op, "stops", stop=["@@never@@"])
    add(op, "lps", logprobs=0)
    assert op.seq_of["plain"][1].plain and not op.seq_of["stops"][1].plain and not op.seq_of["lps"][1].plain
    text, got, finish, stopped = stream(op, ids, ["plain", "stops", "lps"])
    whole = tok.decode(ids)
    assert whole == TEXT  # the text round-trips, so each stream must give exactly this
    assert text == {"plain": whole, "stops": whole, "lps": whole}
    assert got == {"plain": ids, "stops": ids, "lps": ids}
    assert finish == {"plain": "length", "stops": "length", "lps": "length"} and stopped == []
    assert plain.finished and not op.has_unfinished()


def test_a_stop_string_cuts_the_text_and_is_reported(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    op = OutputProcessor(tok)
    add(op, "plain")
    add(op, "stop", stop=["\u65e5\u672c"])
    text, _, finish, stopped = stream(op, ids, ["plain", "stop"])
    assert text["plain"] == TEXT
    assert text["stop"] == TEXT[:TEXT.index("\u65e5\u672c")]
    assert finish["stop"] == "stop" and stopped == ["stop"]
