"""What the wheel promises: one version number, type information (py.typed and a _core.pyi in step with the
built extension), runtime dependencies declared exactly as the package imports them, and an installed
extension whose RPATH never points into the build machine."""
import ast
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PKG = REPO / "python" / "tallow"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())

# Import name -> distribution name, where they differ (names compared after PEP 503 normalisation).
IMPORT_TO_DIST = {"zmq": "pyzmq", "yaml": "pyyaml", "google": "protobuf", "PIL": "pillow",
                  "sklearn": "scikit-learn", "llama_cpp": "llama-cpp-python", "pybind11_stubgen": "pybind11-stubgen"}
# Imported by tests but installed outside the extras, on purpose:
TEST_ONLY_OUTSIDE_EXTRAS = {
    "torch": "the reference's CPU build is pinned and installed first by .ci/run (a plain pip would pull CUDA torch)",
    "llama_cpp": "the llama.cpp peer, built from source by hand; its tests skip without it and "
                 "tests/fixtures/make_smollm2_llamacpp.py is run by hand",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _dist_names(requirements: list[str]) -> set[str]:
    return {_norm(re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", r).group(1)) for r in requirements}


def _guarded(node: ast.AST, parents: dict) -> bool:
    """True for an import inside `try: ... except ImportError` (an optional dependency)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for h in parent.handlers:
                names = {n.id for n in ast.walk(h.type) if isinstance(n, ast.Name)} if h.type is not None else {"ImportError"}
                if names & {"ImportError", "ModuleNotFoundError", "Exception"}:
                    return True
        node = parent
    return False


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.If) and "TYPE_CHECKING" in ast.unparse(parent.test) and node in parent.body:
            return True
        node = parent
    return False


def _in_function(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return True
    return False


def third_party_imports(files, local: set[str], lazy_is_optional: bool) -> dict[str, dict[str, list[str]]]:
    """{top-level module: {"required" | "optional": [file:line, ...]}} of the absolute imports in `files`
    that are neither the standard library, tallow, nor a local module. Optional: inside try/except
    ImportError, or (lazy_is_optional) inside a function, where a feature that needs an extra imports it."""
    found: dict[str, dict[str, list[str]]] = {}
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            if _type_checking_only(node, parents):
                continue
            optional = _guarded(node, parents) or (lazy_is_optional and _in_function(node, parents))
            kind = "optional" if optional else "required"
            for name in names:
                top = name.split(".")[0]
                if top in sys.stdlib_module_names or top == "tallow" or top in local:
                    continue
                found.setdefault(top, {}).setdefault(kind, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


# ---- one version ---------------------------------------------------------------------------------
VERSION_FILE = PKG / "_version.py"
# scikit-build-core's default pattern for its regex metadata provider (what the build reads).
VERSION_RE = re.compile(r"""(?i)^(__version__|VERSION)(?: ?\: ?str)? *= *(['"])v?(?P<value>.+?)\2""", re.MULTILINE)


def test_the_version_is_written_once_and_read_by_the_build_and_the_package():
    project = PYPROJECT["project"]
    assert "version" not in project and "version" in project.get("dynamic", [])
    provider = PYPROJECT["tool"]["scikit-build"]["metadata"]["version"]
    assert provider["provider"] == "scikit_build_core.metadata.regex"
    assert REPO / provider["input"] == VERSION_FILE
    version = VERSION_RE.search(VERSION_FILE.read_text()).group("value")
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", version), version
    # No other file of the package writes tallow's version out.
    for path in PKG.rglob("*.py"):
        if path != VERSION_FILE:
            assert not re.search(r"^\s*__version__\s*(:\s*str\s*)?=\s*['\"]", path.read_text(), re.MULTILINE), \
                f"{path} writes a version of its own"
    import tallow

    assert tallow.__version__ == version


def test_cli_prints_the_version():
    cmd = [sys.executable, "-c", "import sys; from tallow.cli import main; sys.exit(main(['--version']))"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # what the `tallow` script runs
    assert out.returncode == 0, out.stderr
    version = VERSION_RE.search(VERSION_FILE.read_text()).group("value")
    assert out.stdout.strip() == f"tallow {version}"


# ---- typing ----------------------------------------------------------------------------------------
def test_the_package_is_marked_typed_and_ships_the_stub():
    assert (PKG / "py.typed").is_file()
    assert (PKG / "_core.pyi").is_file()
    # scikit-build-core copies every file of the listed package folders into the wheel.
    assert PYPROJECT["tool"]["scikit-build"]["wheel"]["packages"] == ["python/tallow"]


STUB = PKG / "_core.pyi"


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    """(module-level names, {class: member names}) of the committed stub."""
    tree = ast.parse(STUB.read_text())
    top, members = set(), {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            top.add(node.target.id)
        if isinstance(node, ast.ClassDef):
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.ClassDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
            members[node.name] = names
    return top, members


def _runtime_public(obj) -> set[str]:
    return {n for n in dir(obj) if not (n.startswith("__") and n.endswith("__"))}


def _own_public(cls) -> set[str]:
    return {n for n in vars(cls) if not n.startswith("_")}


def _cuda_only_names() -> set[str]:
    """Names of _core.cuda in a CUDA build (cuda/python/*.cpp: bind_cuda.cpp and the files it calls) that
    the CPU stand-in (cpp/python/bind_cuda.cpp) does not define."""
    cuda_src = "".join(f.read_text() for f in sorted((REPO / "cuda" / "python").glob("*.cpp")))
    cuda = set(re.findall(r'\bc\.def\(\s*"(\w+)"', cuda_src))
    cuda |= set(re.findall(r'py::class_<[^;]*?>\(\s*c\s*,\s*"(\w+)"', cuda_src))
    cuda |= set(re.findall(r'\bc\.attr\(\s*"(\w+)"\s*\)', cuda_src))
    return cuda - _stand_in_names()


def _stand_in_names() -> set[str]:
    src = (REPO / "cpp" / "python" / "bind_cuda.cpp").read_text()
    return set(re.findall(r'"([A-Za-z_]\w*)"', src)) - {"cuda"}


def _stub_kind() -> str:
    m = re.search(r"generated from a (CPU|CUDA) build", STUB.read_text())
    assert m, "the stub's header says which build it came from"
    return m.group(1)


def test_the_parsers_of_the_cuda_bindings_see_what_the_module_has():
    from tallow import _core

    assert _cuda_only_names(), "no CUDA-only names parsed from cuda/python/*.cpp"
    runtime = _runtime_public(_core.cuda)
    if not _core.cuda.built:
        assert runtime == _stand_in_names(), "cpp/python/bind_cuda.cpp and the CPU module disagree"
    else:
        assert _cuda_only_names() <= runtime


def test_the_stub_names_what_the_built_module_has():
    """Module, class and cuda-submodule names: the committed stub and the built extension agree. The stub is
    generated from a CPU build (tools/gen_core_stub.py); a CUDA build's _core.cuda may differ from it by
    exactly the CUDA-only names, read from cuda/python/*.cpp."""
    from tallow import _core

    top, members = _stub_names()
    hint = "regenerate it: python tools/gen_core_stub.py <build dir>"
    runtime_top = _runtime_public(_core)
    assert top == runtime_top, f"_core.pyi: missing {runtime_top - top}, extra {top - runtime_top}; {hint}"
    for name in sorted(members):
        if name == "cuda":
            continue
        cls = getattr(_core, name)
        assert members[name] - {n for n in members[name] if n.startswith("_")} == _own_public(cls), \
            f"_core.pyi class {name}: {hint}"
    module_kind = "CUDA" if _core.cuda.built else "CPU"
    allowed = _cuda_only_names() if module_kind != _stub_kind() else set()
    stub_cuda, runtime_cuda = members["cuda"], _runtime_public(_core.cuda)
    assert (stub_cuda ^ runtime_cuda) <= allowed, \
        f"_core.pyi class cuda ({_stub_kind()} stub, {module_kind} module): " \
        f"missing {runtime_cuda - stub_cuda - allowed}, extra {stub_cuda - runtime_cuda - allowed}; {hint}"


# ---- dependencies ----------------------------------------------------------------------------------
def _declared() -> tuple[set[str], dict[str, set[str]]]:
    project = PYPROJECT["project"]
    extras = {k: _dist_names(v) for k, v in project.get("optional-dependencies", {}).items()}
    return _dist_names(project["dependencies"]), extras


def _dist(import_name: str) -> str:
    return _norm(IMPORT_TO_DIST.get(import_name, import_name))


def test_every_runtime_import_is_a_declared_dependency_and_every_dependency_is_imported():
    deps, extras = _declared()
    imports = third_party_imports(sorted(PKG.rglob("*.py")), local=set(), lazy_is_optional=True)
    any_extra = set().union(*extras.values())
    for name, where in sorted(imports.items()):
        if "required" in where:
            assert _dist(name) in deps, f"{name} is imported at run time ({where['required'][:3]}) but is not " \
                                        f"in pyproject's dependencies"
        else:
            assert _dist(name) in deps | any_extra, f"{name} is imported by optional features " \
                                                    f"({where['optional'][:3]}) but neither a dependency nor in an extra"
    unused = deps - {_dist(n) for n in imports}
    assert not unused, f"declared in pyproject's dependencies but never imported by python/tallow: {unused}"


def test_every_test_import_is_declared_for_the_tests():
    deps, extras = _declared()
    local = {p.stem for d in ("tests", "benchmarks") for p in (REPO / d).rglob("*.py")}
    local |= {p.name for d in ("tests", "benchmarks") for p in (REPO / d).rglob("*") if p.is_dir()}
    imports = third_party_imports(sorted((REPO / "tests").rglob("*.py")), local=local, lazy_is_optional=False)
    for name, where in sorted(imports.items()):
        if "required" not in where or name in TEST_ONLY_OUTSIDE_EXTRAS:
            continue  # optional imports skip their tests when absent
        assert _dist(name) in deps | extras.get("test", set()), \
            f"the tests import {name} ({where['required'][:3]}) but the test extra does not declare it"


# ---- RPATH -----------------------------------------------------------------------------------------
def _cmake_build_dir(path: pathlib.Path) -> pathlib.Path | None:
    for parent in path.parents:
        if (parent / "CMakeCache.txt").is_file():
            return parent
    return None


@pytest.mark.skipif(shutil.which("readelf") is None, reason="readelf (binutils) is not installed")
def test_the_installed_extension_has_no_absolute_rpath():
    """An installed _core carries only $ORIGIN-relative RPATH/RUNPATH entries. From a CMake build tree (whose
    own binary may point at the toolkit it linked), the RPATH the install step writes is checked instead."""
    from tallow import _core

    so = pathlib.Path(_core.__file__)
    build = _cmake_build_dir(so)
    if build is None:
        dyn = subprocess.run(["readelf", "-d", str(so)], capture_output=True, text=True, check=True).stdout
        paths = re.findall(r"\((?:RPATH|RUNPATH)\)\s+Library (?:rpath|runpath): \[(.*)\]", dyn)
        where = f"readelf -d {so}"
    else:
        script = (build / "cmake_install.cmake").read_text()
        assert so.name in script, f"{build}/cmake_install.cmake does not install {so.name}"
        # Values are quoted, or bracketed ([[...]]) when they hold a `$` such as $ORIGIN.
        values = re.findall(r'(?:NEW_RPATH|RPATH_CHECK\s+FILE\s+"[^"]*"\s+RPATH)\s+(?:"([^"]*)"|\[(=*)\[(.*?)\]\2\])',
                            script, re.DOTALL)
        paths = [quoted or bracketed for quoted, _, bracketed in values]
        assert paths, f"no RPATH rule for {so.name} in {build}/cmake_install.cmake"
        where = f"{build}/cmake_install.cmake"
    entries = [e for p in paths for e in p.split(":") if e]
    absolute = [e for e in entries if not e.startswith("$ORIGIN")]
    assert not absolute, f"{where}: RPATH entries outside the package: {absolute}"
