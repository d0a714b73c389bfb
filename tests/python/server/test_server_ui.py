"""The --ui-server chat page in headless Chromium (Debian's chromium and chromium-driver), driven
through the W3C WebDriver protocol: type a message, click send, see the streamed reply rendered
as markdown; the stop button aborts a reply (its KV blocks are freed) and the page stays usable."""
import json
import shutil
import socket
import subprocess
import time
import urllib.request

import pytest

from server_harness import ScriptedEngine, ServerThread, write_tiny_llama  # noqa: E402
from tallow.engine.args import EngineArgs  # noqa: E402
from tallow.engine.engine import LLMEngine  # noqa: E402

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER),
                                reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)")
ELEMENT = "element-6066-11e4-a52e-4f735466cecf"


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class WebDriver:
    def __init__(self):
        self.port = _free_port()
        self.proc = subprocess.Popen([DRIVER, f"--port={self.port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        for _ in range(100):
            try:
                if self._call("GET", "/status")["value"]["ready"]:
                    break
            except OSError:
                time.sleep(0.1)
        caps = {"capabilities": {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": {
            "binary": CHROMIUM, "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                                         "--window-size=1200,900"]}}}}
        self.session = self._call("POST", "/session", caps)["value"]["sessionId"]

    def _call(self, method, path, body=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            return json.loads(r.read())

    def cmd(self, method, path, body=None):
        return self._call(method, f"/session/{self.session}{path}", body)["value"]

    def get(self, url):
        self.cmd("POST", "/url", {"url": url})

    def find(self, css):
        return self.cmd("POST", "/element", {"using": "css selector", "value": css})[ELEMENT]

    def type(self, css, text):
        self.cmd("POST", f"/element/{self.find(css)}/value", {"text": text})

    def click(self, css):
        self.cmd("POST", f"/element/{self.find(css)}/click", {})

    def js(self, script, *args):
        return self.cmd("POST", "/execute/sync", {"script": script, "args": list(args)})

    def wait(self, script, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(script)
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for: {script}")

    def quit(self):
        try:
            self._call("DELETE", f"/session/{self.session}")
        finally:
            self.proc.terminate()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def driver():
    d = WebDriver()
    yield d
    d.quit()


@pytest.fixture
def tokenizer_dir(tmp_path):
    return write_tiny_llama(tmp_path / "m", seed=2)


def test_send_a_message_and_see_the_streamed_reply(driver, tokenizer_dir):
    from tallow.tokenizer import Tokenizer

    eng = ScriptedEngine(Tokenizer.from_pretrained_dir(tokenizer_dir))
    eng.default = ["Here", " is", " **bold**", " and", " `code`", ":\n\n", "- one\n", "- two"]
    real_step = eng.step

    def slow_step():  # slow enough that the page shows partial text while streaming
        time.sleep(0.15)
        return real_step()

    eng.step = slow_step
    srv = ServerThread(eng, model_names=["ui-model"], ui=True)
    try:
        driver.get(srv.base_url + "/")
        driver.wait("return document.getElementById('model').textContent.includes('ui-model')")
        driver.type("#input", "Hello there")
        driver.click("#send")
        partial = driver.wait("const m = document.querySelector('.msg.assistant.streaming .content');"
                              "return m && m.textContent.length > 0 ? m.textContent : null")
        assert "Here" in partial and "two" not in partial  # streamed: seen before the end
        html = driver.wait("const m = document.querySelector('.msg.assistant.done .content');"
                           "return m ? m.innerHTML : null")
        assert "<strong>bold</strong>" in html and "<code>code</code>" in html
        assert "<li>one</li>" in html and "<li>two</li>" in html
        assert driver.js("return document.querySelector('.msg.user .content').textContent") == "Hello there"
        assert driver.js("return document.getElementById('send').disabled") is False
    finally:
        srv.stop()


def test_stop_button_aborts_the_reply(driver, tokenizer_dir):
    eng = LLMEngine(EngineArgs(model=str(tokenizer_dir), num_kv_blocks=64))
    eng.eos_ids = set()  # the random model must not end the reply by itself before Stop is clicked
    real_step = eng.step

    def slow_step():
        time.sleep(0.02)
        return real_step()

    eng.step = slow_step
    srv = ServerThread(eng, model_names=["tiny"], ui=True)
    try:
        driver.get(srv.base_url + "/")
        driver.wait("return document.getElementById('model').textContent.includes('tiny')")
        driver.js("document.getElementById('max_tokens').value = '400'")
        driver.type("#input", "t5 t6")
        driver.click("#send")
        driver.wait("const m = document.querySelector('.msg.assistant.streaming .content');"
                    "return m && m.textContent.length > 0")
        driver.click("#stop")
        driver.wait("return document.querySelector('.msg.assistant.done') !== null")
        srv.wait_idle(timeout=10)
        free, total = srv.pool_state()
        assert free == total
        assert eng.stats["generation_tokens"] < 400
        assert driver.js("return document.getElementById('stop').hidden") is True
    finally:
        srv.stop()
