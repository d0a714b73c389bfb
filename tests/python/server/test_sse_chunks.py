"""The streaming chunks of server/serving.py, built from a per-request frame (the fields every chunk repeats,
encoded once) around each choice: the same JSON values as encoding the whole chunk, UTF-8 unescaped."""
import json

from tallow.server.serving import _ChunkFrame, _dumps, _sse

FIELDS = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "m\u00e9",
          "system_fingerprint": "fp_0123456789"}


def parse(event: bytes):
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n\n") == 1
    return json.loads(event[6:].decode("utf-8"))


def test_a_choice_chunk_is_the_whole_chunk_as_json():
    choice = {"index": 0, "delta": {"content": "caf\u00e9 \u65e5\u672c \U0001f642 \"q\"\n\\"}, "logprobs": None,
              "finish_reason": None}
    for include_usage in (False, True):
        got = parse(_ChunkFrame(FIELDS, include_usage).choice(choice))
        want = dict(FIELDS, choices=[choice])
        if include_usage:
            want["usage"] = None
        assert got == want


def test_the_usage_chunk_has_no_choices():
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
    assert parse(_ChunkFrame(FIELDS, True).usage(usage)) == dict(FIELDS, choices=[], usage=usage)


def test_non_ascii_is_written_as_utf8_not_escaped():
    ev = _ChunkFrame(FIELDS, False).choice({"index": 0, "text": "\u65e5\u672c"})
    assert "\u65e5\u672c".encode() in ev and b"\\u" not in ev
    assert _dumps({"a": "\u00e9"}) == '{"a":"\u00e9"}'
    assert parse(_sse({"x": [1, None, 2.5]})) == {"x": [1, None, 2.5]}
