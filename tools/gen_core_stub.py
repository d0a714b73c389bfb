#!/usr/bin/env python3
"""Writes python/tallow/_core.pyi, the type stub of the pybind11 extension tallow._core, from a build.

    python tools/gen_core_stub.py build/dev            # the build folder (or its _core*.so); rewrites the stub
    python tools/gen_core_stub.py build/dev --check    # exit 1 and print a diff when the stub is stale

Needs pybind11-stubgen (pip install pybind11-stubgen==3.0.0). The module is imported alone, from a
temporary package holding only the .so, so a stale python/tallow cannot stop the generation. stubgen's
output is fixed up here, not by hand:
  - its stub package (_core/__init__.pyi + _core/cuda.pyi) becomes one file: the submodule ``cuda``
    (an attribute of _core at run time, not an importable module) is written as ``class cuda`` with
    static methods, so no ``tallow/_core/`` folder can shadow a missing extension;
  - ``_core.bool`` (the DType) hides the builtin inside the stub: annotations say ``builtins.bool``;
  - values stubgen copies from this build (``build_info = {'cuda': False, ...}``) are dropped: types only.
The committed stub comes from a CPU build; a CUDA build's ``_core.cuda`` has more names, which
tests/python/test_packaging.py reads from cuda/python/bind_cuda.cpp and allows.
"""
from __future__ import annotations

import argparse
import difflib
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STUB = os.path.join(ROOT, "python", "tallow", "_core.pyi")


def find_extension(path: str) -> str:
    if os.path.isfile(path):
        return path
    found = sorted(glob.glob(os.path.join(path, "python", "tallow", "_core*.so"))
                   + glob.glob(os.path.join(path, "_core*.so")) + glob.glob(os.path.join(path, "tallow", "_core*.so")))
    if not found:
        sys.exit(f"gen_core_stub: no _core*.so in {path} (build it first: cmake --build <build> --target _core)")
    return found[0]


def run_stubgen(so_path: str, out_dir: str) -> tuple[str, str | None]:
    """(text of _core/__init__.pyi, text of _core/cuda.pyi or None) for the extension at so_path."""
    pkg = os.path.join(out_dir, "pkg", "tallow")
    os.makedirs(pkg)
    open(os.path.join(pkg, "__init__.py"), "w").close()
    os.symlink(os.path.abspath(so_path), os.path.join(pkg, os.path.basename(so_path)))
    env = dict(os.environ, PYTHONPATH=os.path.join(out_dir, "pkg"))
    stubs = os.path.join(out_dir, "stubs")
    cmd = [sys.executable, "-m", "pybind11_stubgen", "tallow._core", "-o", stubs, "--exit-code"]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"gen_core_stub: pybind11-stubgen failed:\n{res.stdout}{res.stderr}")
    base = os.path.join(stubs, "tallow", "_core")
    if os.path.isfile(base + ".pyi"):  # a module without submodules
        return open(base + ".pyi").read(), None
    cuda = os.path.join(base, "cuda.pyi")
    return open(os.path.join(base, "__init__.pyi")).read(), (open(cuda).read() if os.path.exists(cuda) else None)


_HEADER_IMPORT = re.compile(r"^(from __future__ import annotations|import [\w.]+|from [\w.]+ import [\w, ]+)$")


def split_module(text: str) -> tuple[str, list[str], list[str]]:
    """(docstring, import lines, body lines) of a stubgen module; drops __all__ (recomputed by readers)."""
    lines = text.splitlines()
    doc = ""
    i = 0
    if lines and lines[0] == '"""':
        j = lines.index('"""', 1)
        doc = "\n".join(lines[1:j]).strip()
        i = j + 1
    imports, body = [], []
    for line in lines[i:]:
        if not body and _HEADER_IMPORT.match(line):
            imports.append(line)
        elif line.startswith("__all__"):
            continue
        else:
            body.append(line)
    return doc, imports, body


_TOP_ASSIGN = re.compile(r"^(\w+): (.+?)(?: = .*)?$")


def drop_values(lines: list[str]) -> list[str]:
    """Top-level `name: T = value` -> `name: T`: the value is this build's, not the API's."""
    return [(_TOP_ASSIGN.sub(r"\1: \2", ln) if ln and not ln[0].isspace() and not ln.startswith(("def ", "class ", "@")) else ln)
            for ln in lines]


def as_class(name: str, doc: str, body: list[str]) -> list[str]:
    """A stubgen submodule as `class name:` (functions -> static methods, variables -> ClassVar)."""
    classes = [m.group(1) for ln in body if (m := re.match(r"^class (\w+)", ln))]
    out = [f"class {name}:", '    """', f"    {doc}" if doc else "    A submodule of tallow._core.",
           "", f"    At run time an attribute of tallow._core (a module made by pybind11's def_submodule, not",
           "    importable on its own); a class here so that one stub file describes the whole extension.", '    """']
    for ln in body:
        if not ln.strip():
            continue
        for cls in classes:  # nested classes are reached through the outer class from module scope
            if not ln.startswith(f"class {cls}"):
                ln = re.sub(rf"(?<![\w.]){cls}\b", f"{name}.{cls}", ln)
        if ln.startswith("def "):
            out.append("    @staticmethod")
        elif (m := _TOP_ASSIGN.match(ln)) and not ln.startswith(("class ", "@")):
            ln = f"{m.group(1)}: typing.ClassVar[{m.group(2)}]"
        out.append("    " + ln)
    return out


_BOOL_ANNOTATION = re.compile(r"(->\s*|:\s*|\[|\|\s*|,\s*)bool\b")


def generate(so_path: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        main_text, cuda_text = run_stubgen(so_path, tmp)
    doc, imports, body = split_module(main_text)
    imports = [ln for ln in imports if ln != "from . import cuda"]
    body = drop_values(body)
    if cuda_text is not None:
        cdoc, cimports, cbody = split_module(cuda_text)
        imports += [ln for ln in cimports if ln not in imports and not ln.startswith("from . ")]
        body += as_class("cuda", cdoc, drop_values(cbody))
    text = "\n".join(body)
    text = text.replace("tallow._core.", "")  # the module's own names, unqualified
    text = _BOOL_ANNOTATION.sub(r"\1builtins.bool", text)
    imports = [ln for ln in imports if ln != "import tallow._core"]
    if "import builtins" not in imports:
        imports.insert(1, "import builtins")
    kind = "CUDA" if cuda_text is not None and "class Stream" in cuda_text else "CPU"
    header = [
        f"# Type stub of tallow._core, generated from a {kind} build by tools/gen_core_stub.py (pybind11-stubgen):",
        "# regenerate it after changing the bindings, never edit it by hand.",
        '"""', doc, '"""',
    ]
    return "\n".join(header + imports + [text.rstrip(), ""])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="the CMake build folder (or the _core*.so itself)")
    ap.add_argument("--check", action="store_true", help="compare with python/tallow/_core.pyi instead of writing it")
    ap.add_argument("-o", "--output", default=STUB, help="where to write the stub (default: %(default)s)")
    ns = ap.parse_args()
    if shutil.which("pybind11-stubgen") is None and subprocess.run(
            [sys.executable, "-c", "import pybind11_stubgen"], capture_output=True).returncode != 0:
        sys.exit("gen_core_stub: pybind11-stubgen is not installed (pip install pybind11-stubgen==3.0.0)")
    text = generate(find_extension(ns.build))
    if ns.check:
        old = open(ns.output).read() if os.path.exists(ns.output) else ""
        if old == text:
            print(f"gen_core_stub: {ns.output} is up to date")
            return 0
        sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), text.splitlines(True), ns.output, "generated"))
        print(f"gen_core_stub: {ns.output} is stale: python tools/gen_core_stub.py {ns.build}")
        return 1
    with open(ns.output, "w") as f:
        f.write(text)
    print(f"gen_core_stub: wrote {ns.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
