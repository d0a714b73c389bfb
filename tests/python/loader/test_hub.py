"""Hub downloads for real: a small aiohttp app on 127.0.0.1 serves tiny repositories the way the
Hugging Face hub does (the model-info and tree APIs, HEAD/GET /resolve with ETag, X-Repo-Commit
and Content-Length, X-Error-Code on errors), and huggingface_hub fetches from it through
HF_ENDPOINT. huggingface_hub reads HF_ENDPOINT / HF_HOME / HF_HUB_OFFLINE at import, so every
download runs in a fresh subprocess with its own environment."""
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

web = pytest.importorskip("aiohttp.web")
pytest.importorskip("huggingface_hub")
st_numpy = pytest.importorskip("safetensors.numpy")
gguf = pytest.importorskip("gguf")

SHA = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_tallowtesttoken"


def _safetensors_bytes(tensors, tmp_dir, name):
    path = os.path.join(tmp_dir, name)
    st_numpy.save_file(tensors, path)
    return open(path, "rb").read()


def _gguf_bytes(tmp_dir, name, rng):
    path = os.path.join(tmp_dir, name)
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", rng.standard_normal((8, 32)).astype(np.float32))
    w.add_tensor("output_norm.weight", rng.standard_normal(32).astype(np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return open(path, "rb").read()


def build_repos(tmp_dir):
    rng = np.random.default_rng(0)
    shard1 = {"model.embed_tokens.weight": rng.standard_normal((8, 4)).astype(np.float32)}
    shard2 = {"model.norm.weight": rng.standard_normal(4).astype(np.float32)}
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                                             "model.norm.weight": "model-00002-of-00002.safetensors"}}
    tiny = {
        "config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}).encode(),
        "generation_config.json": b'{"eos_token_id": [2, 3]}',
        "tokenizer.json": b'{"version": "1.0"}',
        "tokenizer_config.json": b'{"chat_template": "{{ messages }}"}',
        "chat_template.jinja": b"{{ messages }}",
        "README.md": b"# tiny\n",
        "pytorch_model.bin": b"\0" * 64,
        "consolidated.safetensors": _safetensors_bytes(shard2, tmp_dir, "c.safetensors"),
        "original/consolidated.safetensors": _safetensors_bytes(shard2, tmp_dir, "o.safetensors"),
        "model.safetensors.index.json": json.dumps(index).encode(),
        "model-00001-of-00002.safetensors": _safetensors_bytes(shard1, tmp_dir, "s1.safetensors"),
        "model-00002-of-00002.safetensors": _safetensors_bytes(shard2, tmp_dir, "s2.safetensors"),
    }
    single = {"config.json": b"{}", "model.safetensors": _safetensors_bytes(shard1, tmp_dir, "m.safetensors")}
    return {
        "tallow-test/tiny": {"files": tiny},
        "tallow-test/single": {"files": single},
        "tallow-test/gated": {"files": dict(single), "gated": True},
        "tallow-test/tiny-gguf": {"files": {"README.md": b"gguf\n",
                                            "tiny-Q8_0.gguf": _gguf_bytes(tmp_dir, "a.gguf", rng),
                                            "tiny-F16.gguf": _gguf_bytes(tmp_dir, "b.gguf", rng)}},
        "tallow-test/one-gguf": {"files": {"tiny.gguf": _gguf_bytes(tmp_dir, "c.gguf", rng),
                                           "mmproj-tiny-f16.gguf": b"GGUF" + b"\0" * 60}},
        "tallow-test/no-weights": {"files": {"README.md": b"nothing\n", "config.json": b"{}"}},
    }


class FakeHub:
    """The hub endpoints huggingface_hub's snapshot_download / hf_hub_download / model_info use."""

    def __init__(self, repos):
        self.repos = repos
        self.log: list[tuple[str, str]] = []

    def _repo(self, request):
        repo_id = f"{request.match_info['org']}/{request.match_info['name']}"
        return repo_id, self.repos.get(repo_id)

    @staticmethod
    def _error(status, code, message):
        return web.Response(status=status, text=json.dumps({"error": message}),
                            headers={"X-Error-Code": code, "X-Error-Message": message},
                            content_type="application/json")

    def _rev_ok(self, rev):
        return rev in ("main", SHA)

    async def info(self, request):
        self.log.append((request.method, request.path))
        repo_id, repo = self._repo(request)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found")
        if not self._rev_ok(request.match_info.get("rev", "main")):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        return web.json_response({
            "id": repo_id, "modelId": repo_id, "sha": SHA, "private": False,
            "gated": "manual" if repo.get("gated") else False,
            "siblings": [{"rfilename": f} for f in repo["files"]],
        })

    async def tree(self, request):
        self.log.append((request.method, request.path))
        repo_id, repo = self._repo(request)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found")
        return web.json_response([
            {"type": "file", "path": f, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
            for f, data in repo["files"].items()])

    async def resolve(self, request):
        self.log.append((request.method, request.path))
        repo_id, repo = self._repo(request)
        if repo is None:
            return self._error(401, "RepoNotFound", "Repository not found")
        if not self._rev_ok(request.match_info["rev"]):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if repo.get("gated") and request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return self._error(401, "GatedRepo", f"Access to model {repo_id} is restricted. You must have access "
                                                 "to it and be authenticated to access it. Please log in.")
        data = repo["files"].get(request.match_info["path"])
        if data is None:
            return self._error(404, "EntryNotFound", "Entry not found")
        headers = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "X-Repo-Commit": SHA,
                   "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            headers["Content-Length"] = str(len(data))
            return web.Response(status=200, headers=headers)
        return web.Response(body=data, headers=headers, content_type="application/octet-stream")

    def app(self):
        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", self.info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", self.info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", self.tree)
        app.router.add_route("HEAD", "/{org}/{name}/resolve/{rev}/{path:.+}", self.resolve)
        app.router.add_route("GET", "/{org}/{name}/resolve/{rev}/{path:.+}", self.resolve)
        return app

    def downloads(self):
        """Files fetched with GET /resolve, as (repo, path)."""
        out = []
        for method, path in self.log:
            parts = path.split("/")
            if method == "GET" and len(parts) > 5 and parts[3] == "resolve":
                out.append((f"{parts[1]}/{parts[2]}", "/".join(parts[5:])))
        return out


@pytest.fixture(scope="module")
def hub_server(tmp_path_factory):
    hub = FakeHub(build_repos(str(tmp_path_factory.mktemp("repos"))))
    loop = asyncio.new_event_loop()
    started = threading.Event()
    state = {}

    async def start():
        runner = web.AppRunner(hub.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        state["runner"] = runner
        state["port"] = runner.addresses[0][1]

    def serve():
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        started.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert started.wait(30), "fake hub did not start"
    hub.endpoint = f"http://127.0.0.1:{state['port']}"
    yield hub
    asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


_RUNNER = textwrap.dedent("""
    import json, sys
    args = json.loads(sys.argv[1])
    try:
        if args.pop("via_source", False):
            from tallow.loader.source import resolve_model_source
            s = resolve_model_source(**args)
            out = {"path": s.path, "kind": s.kind}
        else:
            from tallow.loader.hub import download_model
            out = {"path": download_model(**args)}
    except Exception as e:
        out = {"error": type(e).__name__, "message": str(e), "mro": [c.__name__ for c in type(e).__mro__]}
    print("RESULT " + json.dumps(out))
""")


def download(hub, hf_home, offline=False, token_env=None, **kwargs):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(HF_ENDPOINT=hub.endpoint, HF_HOME=str(hf_home), HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_ETAG_TIMEOUT="10", NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost",
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if token_env:
        env["HF_TOKEN"] = token_env
    proc = subprocess.run([sys.executable, "-c", _RUNNER, json.dumps(kwargs)], env=env, capture_output=True,
                          text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no result (rc={proc.returncode})\nstdout:{proc.stdout}\nstderr:{proc.stderr}"
    out = json.loads(lines[-1][len("RESULT "):])
    out["stderr"] = proc.stderr
    return out


def test_download_fetches_only_what_is_needed(hub_server, tmp_path):
    hub = hub_server
    before = len(hub.log)
    out = download(hub, tmp_path, repo_id="tallow-test/tiny")
    assert "error" not in out, out
    root = out["path"]
    assert os.path.isdir(root)
    got = sorted(os.path.relpath(os.path.join(d, f), root) for d, _, fs in os.walk(root) for f in fs)
    assert got == sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                          "chat_template.jinja", "model.safetensors.index.json",
                          "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"])
    fetched = {p for r, p in hub.downloads() if r == "tallow-test/tiny"}
    assert not fetched & {"README.md", "pytorch_model.bin", "consolidated.safetensors",
                          "original/consolidated.safetensors"}
    assert len(hub.log) > before
    # what came down loads
    from tallow.loader.safetensors_loader import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(root)
    assert set(ckpt) == {"model.embed_tokens.weight", "model.norm.weight"}
    # progress bars were shown (huggingface_hub's tqdm writes to stderr)
    assert "Fetching" in out["stderr"] or "%" in out["stderr"]

    # second run: offline, served from the cache, no request reaches the server
    n = len(hub.log)
    again = download(hub, tmp_path, offline=True, repo_id="tallow-test/tiny")
    assert again.get("path") == root, again
    assert len(hub.log) == n

    # through resolve_model_source, also offline
    src = download(hub, tmp_path, offline=True, via_source=True, m="tallow-test/tiny")
    assert src == {"path": root, "kind": "safetensors", "stderr": src["stderr"]}


def test_single_file_repo_and_unreachable_hub(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/single", revision=SHA)
    assert sorted(os.listdir(out["path"])) == ["config.json", "model.safetensors"]

    class Dead:  # nothing listens on port 1
        endpoint = "http://127.0.0.1:1"

    # hub unreachable (not offline mode): the cached snapshot is used
    again = download(Dead, tmp_path, repo_id="tallow-test/single", revision=SHA)
    assert again.get("path") == out["path"], again
    # hub unreachable and nothing cached: a clear error
    miss = download(Dead, tmp_path, repo_id="tallow-test/tiny")
    assert miss["error"] == "NotCachedError", miss
    assert "tallow-test/tiny" in miss["message"] and "cannot be reached" in miss["message"]


def test_offline_not_cached(hub_server, tmp_path):
    n = len(hub_server.log)
    out = download(hub_server, tmp_path, offline=True, repo_id="tallow-test/single")
    assert out["error"] == "NotCachedError", out
    assert "ValueError" in out["mro"] and "FileNotFoundError" in out["mro"]
    assert "tallow-test/single" in out["message"] and "HF_HUB_OFFLINE" in out["message"]
    assert len(hub_server.log) == n


def test_gated_repo_without_token(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/gated")
    assert out["error"] == "GatedRepoAccessError", out
    assert "ValueError" in out["mro"]
    msg = out["message"]
    assert "tallow-test/gated" in msg and "HF_TOKEN" in msg and "huggingface-cli login" in msg
    assert "Traceback" not in msg


def test_gated_repo_with_hf_token(hub_server, tmp_path):
    out = download(hub_server, tmp_path, token_env=TOKEN, repo_id="tallow-test/gated")
    assert "error" not in out, out
    assert "model.safetensors" in os.listdir(out["path"])


def test_gated_repo_with_token_file(hub_server, tmp_path):
    (tmp_path / "token").write_text(TOKEN)
    out = download(hub_server, tmp_path, repo_id="tallow-test/gated")
    assert "error" not in out, out


def test_gated_repo_with_wrong_token(hub_server, tmp_path):
    out = download(hub_server, tmp_path, token_env="hf_wrong", repo_id="tallow-test/gated")
    assert out["error"] == "GatedRepoAccessError", out
    assert "no access" in out["message"]


def test_repo_not_found(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/does-not-exist")
    assert out["error"] == "RepoNotFoundError", out
    assert "ValueError" in out["mro"]
    assert "tallow-test/does-not-exist" in out["message"] and "not found" in out["message"]


def test_no_weights(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/no-weights")
    assert out["error"] == "NoWeightsError", out
    assert "tallow-test/no-weights" in out["message"]


def test_gguf_repo_needs_a_choice(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/tiny-gguf")
    assert out["error"] == "GGUFChoiceError", out
    assert "tiny-F16.gguf" in out["message"] and "tiny-Q8_0.gguf" in out["message"] and "--f" in out["message"]
    out = download(hub_server, tmp_path, repo_id="tallow-test/tiny-gguf", gguf_file="nope.gguf")
    assert out["error"] == "GGUFChoiceError" and "nope.gguf" in out["message"]


def test_gguf_repo_downloads_only_the_chosen_file(hub_server, tmp_path):
    out = download(hub_server, tmp_path, via_source=True, m="tallow-test/tiny-gguf", f="tiny-Q8_0.gguf")
    assert out.get("kind") == "gguf", out
    assert out["path"].endswith("tiny-Q8_0.gguf")
    assert os.listdir(os.path.dirname(out["path"])) == ["tiny-Q8_0.gguf"]
    fetched = [p for r, p in hub_server.downloads() if r == "tallow-test/tiny-gguf"]
    assert "tiny-F16.gguf" not in fetched and "README.md" not in fetched
    from tallow.loader.gguf_weights import load_gguf_weights

    assert set(load_gguf_weights(out["path"])) == {"model.embed_tokens.weight", "model.norm.weight"}


def test_single_gguf_repo_skips_mmproj(hub_server, tmp_path):
    out = download(hub_server, tmp_path, repo_id="tallow-test/one-gguf")
    assert out.get("path", "").endswith("tiny.gguf"), out
    fetched = [p for r, p in hub_server.downloads() if r == "tallow-test/one-gguf"]
    assert fetched == ["tiny.gguf"]
