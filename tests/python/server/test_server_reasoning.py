"""<think>...</think> split into reasoning_content and content, whole and streamed."""
import pytest

from conftest import data_dir
from tallow.server.reasoning import ReasoningStream, prompt_opens_reasoning, split_reasoning, uses_reasoning

CASES = [
    # (model output, prompt opened <think>, reasoning, content)
    ("<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.", False, "\nThe user wants 2+2.\n", "The answer is 4."),
    ("The user wants 2+2. So 4.\n</think>\n\n4", True, "The user wants 2+2. So 4.\n", "4"),  # DeepSeek-R1 style
    ("  <think>a < b and c > d</think>ok", False, "a < b and c > d", "ok"),
    ("Just an answer.", False, None, "Just an answer."),
    ("<think>cut off by max_tokens", False, "cut off by max_tokens", ""),
    ("<think></think>\n\nempty thought", False, "", "empty thought"),
    ("<thinking is not a tag", False, None, "<thinking is not a tag"),
    ("answer mentions </think> late", False, None, "answer mentions </think> late"),
    ("", False, None, ""),
]


@pytest.mark.parametrize("text,opened,reasoning,content", CASES)
def test_whole(text, opened, reasoning, content):
    assert split_reasoning(text, opened) == (reasoning, content)


@pytest.mark.parametrize("text,opened,reasoning,content", CASES)
def test_streamed_in_every_fragmentation(text, opened, reasoning, content, rng):
    splits = [list(range(1, len(text)))] + [sorted(set(rng.integers(1, max(len(text), 2), 4).tolist()))
                                             for _ in range(10)]
    for cuts in splits:
        cuts = [c for c in cuts if 0 < c < len(text)]
        s = ReasoningStream(opened)
        r_all, c_all = "", ""
        pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        for k, piece in enumerate(pieces):
            r, c = s.feed(piece, final=k == len(pieces) - 1)
            r_all += r
            c_all += c
        if not pieces:
            s.feed("", final=True)
        assert (s.reasoning, c_all) == (reasoning, content)
        assert r_all == (reasoning or "")


def test_reasoning_streams_before_the_end_tag():
    s = ReasoningStream()
    assert s.feed("<think>step one, ") == ("step one, ", "")
    assert s.feed("step two</thi") == ("step two", "")
    assert s.feed("nk>\n\nDone") == ("", "Done")


@pytest.mark.parametrize("template,expected", [
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", True),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", False),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", False),
])
def test_which_templates_reason(template, expected):
    path = data_dir() / "chat-templates" / template
    if not path.is_file():
        pytest.skip(f"{path} not found (set TALLOW_TEST_DATA)")
    assert uses_reasoning(path.read_text()) is expected


def test_r1_template_opens_the_think_block():
    path = data_dir() / "chat-templates" / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"
    if not path.is_file():
        pytest.skip(f"{path} not found (set TALLOW_TEST_DATA)")
    from tallow.tokenizer.chat_template import render_chat_template

    prompt = render_chat_template(path.read_text(), [{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    assert prompt_opens_reasoning(prompt) is prompt.rstrip().endswith("<think>")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
