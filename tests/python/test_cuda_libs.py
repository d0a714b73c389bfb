"""tallow/cuda_libs.py: a CUDA build's _core whose RUNPATH misses the nvidia wheels (they sit in another
site-packages) is imported after their cuBLAS is loaded, cuBLASLt first; anything else fails as before.
The real libraries are loaded on a GPU machine by tests/gpu_wheel_check.sh; here the loader is a recorder."""
import importlib
import sys

import pytest

from tallow import cuda_libs

GLIBC_MISSING = "{}: cannot open shared object file: No such file or directory"


@pytest.fixture
def wheel_site(tmp_path, monkeypatch):
    """A site-packages folder on sys.path with an `nvidia` namespace package; returns a function that adds
    empty files as libraries under nvidia/<folder>/lib."""
    site = tmp_path / "site"
    (site / "nvidia").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "nvidia", raising=False)
    monkeypatch.setattr(cuda_libs, "preloaded", [])
    importlib.invalidate_caches()

    def add(folder: str, *names: str) -> list[str]:
        lib = site / "nvidia" / folder / "lib"
        lib.mkdir(parents=True, exist_ok=True)
        for n in names:
            (lib / n).write_bytes(b"")
        return [str(lib / n) for n in names]

    return add


class FakeCore:
    """import_module for tallow._core that fails, naming a library, until the listed libraries are loaded."""

    def __init__(self, needs: list[str]):
        self.needs, self.loaded, self.calls = needs, [], 0

    def load(self, path: str):
        self.loaded.append(path)

    def import_module(self, name: str):
        assert name == "tallow._core"
        self.calls += 1
        have = {p.rsplit("/", 1)[-1] for p in self.loaded}
        for soname in self.needs:
            if soname not in have:
                raise ImportError(GLIBC_MISSING.format(soname))
        return "module"


def test_the_missing_library_is_read_from_the_import_error():
    assert cuda_libs.missing_library(ImportError(GLIBC_MISSING.format("libcublas.so.13"))) == ("libcublas", ".13")
    assert cuda_libs.missing_library(ImportError(GLIBC_MISSING.format("libcublasLt.so.12"))) == ("libcublasLt", ".12")
    assert cuda_libs.missing_library(ImportError("No module named 'tallow._core'")) is None


def test_cublas_from_a_cuda13_wheel_is_loaded_lt_first_then_the_import_is_retried(wheel_site):
    lt, blas = wheel_site("cu13", "libcublasLt.so.13", "libcublas.so.13")
    core = FakeCore(["libcublas.so.13", "libcublasLt.so.13"])
    assert cuda_libs.import_core(load=core.load, import_module=core.import_module) == "module"
    assert core.loaded == [lt, blas] and core.calls == 2
    assert cuda_libs.preloaded == [lt, blas]


def test_a_cuda12_wheel_layout_is_found_too(wheel_site):
    lt, blas = wheel_site("cublas", "libcublasLt.so.12", "libcublas.so.12")
    core = FakeCore(["libcublas.so.12"])
    assert cuda_libs.import_core(load=core.load, import_module=core.import_module) == "module"
    assert core.loaded == [lt, blas]


def test_another_major_version_is_not_loaded_and_the_error_says_what_to_install(wheel_site):
    wheel_site("cublas", "libcublasLt.so.12", "libcublas.so.12")
    core = FakeCore(["libcublas.so.13"])
    with pytest.raises(ImportError, match=r"libcublas\.so\.13.*tallow\[cuda\]"):
        cuda_libs.import_core(load=core.load, import_module=core.import_module)
    assert core.loaded == []


def test_a_library_still_missing_after_loading_ends_in_the_import_error(wheel_site):
    wheel_site("cu13", "libcublasLt.so.13", "libcublas.so.13")
    core = FakeCore(["libcublas.so.13"])
    core.load = lambda path: None  # loading "works" but the import keeps failing: no endless retry
    with pytest.raises(ImportError, match=r"libcublas\.so\.13: cannot open"):
        cuda_libs.import_core(load=core.load, import_module=core.import_module)
    assert core.calls == 2


def test_other_import_errors_are_raised_unchanged(wheel_site):
    def broken(name):
        raise ImportError(GLIBC_MISSING.format("libfoo.so.1"))

    with pytest.raises(ImportError, match=r"^libfoo\.so\.1: cannot open shared object file"):
        cuda_libs.import_core(load=lambda p: pytest.fail("nothing to load"), import_module=broken)


