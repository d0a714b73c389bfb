"""tallow/envs.py: the one module of the Python side that reads environment variables."""
import pathlib
import re

from tallow import envs

PKG = pathlib.Path(envs.__file__).parent


def test_only_envs_reads_the_environment():
    readers = [str(p.relative_to(PKG)) for p in PKG.rglob("*.py")
               if re.search(r"getenv|os\.environ", p.read_text(encoding="utf-8"))]
    assert readers == ["envs.py"], readers


def test_every_tallow_variable_named_in_the_package_is_documented():
    named = set()
    for p in PKG.rglob("*.py"):
        named |= set(re.findall(r"\benvs\.(TALLOW_[A-Z0-9_]+)", p.read_text(encoding="utf-8")))
    assert named <= set(envs.environment_variables), named - set(envs.environment_variables)
    for name, (_, doc) in envs.environment_variables.items():
        assert doc and "default" in doc, name


def test_values_are_typed_with_defaults(monkeypatch, caplog):
    for name in ("TALLOW_OVERLAP_DEPTH", "TALLOW_STEP_TIMING", "TALLOW_GC_FREEZE", "TALLOW_DEBUG", "TALLOW_PYPI_URL"):
        monkeypatch.delenv(name, raising=False)
    assert envs.TALLOW_OVERLAP_DEPTH == 2 and envs.TALLOW_STEP_TIMING is False and envs.TALLOW_GC_FREEZE is True
    assert envs.TALLOW_DEBUG is False and envs.TALLOW_PYPI_URL == "https://pypi.org"
    monkeypatch.setenv("TALLOW_STEP_TIMING", "1")
    monkeypatch.setenv("TALLOW_GC_FREEZE", "0")
    monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", "3")
    assert envs.TALLOW_STEP_TIMING is True and envs.TALLOW_GC_FREEZE is False and envs.TALLOW_OVERLAP_DEPTH == 3
    monkeypatch.setenv("TALLOW_OVERLAP_DEPTH", "many")
    with caplog.at_level("WARNING", logger="tallow"):
        assert envs.TALLOW_OVERLAP_DEPTH == 2
    assert "TALLOW_OVERLAP_DEPTH" in caplog.text
    try:
        envs.TALLOW_NO_SUCH_SWITCH
    except AttributeError:
        pass
    else:
        raise AssertionError("an unknown variable must not read as a value")
