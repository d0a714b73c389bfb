"""The README stays true: every link in it (and in docs/) points inside the repository at a file that
exists, and its client example asks for greedy decoding (the demo model rambles at temperature 1)."""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _docs():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_every_link_stays_in_the_repository():
    checked = 0
    for doc in _docs():
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold example URLs
        for target in LINK.findall(text):
            assert not re.match(r"[a-z]+://", target), f"{doc.name} links outside the repository: {target}"
            path = (doc.parent / target.split("#")[0]).resolve()
            assert ROOT in path.parents or path == ROOT, f"{doc.name}: {target} leaves the repository"
            assert path.exists(), f"{doc.name}: {target} does not exist"
            checked += 1
    assert checked >= 5  # the README does link its docs and results


def test_the_client_example_decodes_greedily():
    text = (ROOT / "README.md").read_text()
    examples = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "chat.completions.create" in b]
    assert examples, "the README has no OpenAI client example"
    for block in examples:
        assert "temperature=0" in block, block
