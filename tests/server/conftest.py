"""Black-box tests of `quiver serve`: a real server on 127.0.0.1 (a free port), the smollm2-135m
model, and the official `openai` client."""

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KEY = "test-key-123"


def model_path() -> Path:
    home = Path(os.environ.get("QUIVER_HOME") or Path.home() / ".cache" / "quiver")
    p = home / "models" / "smollm2-135m.gguf"
    if not p.is_file():
        pytest.fail(f"{p} is missing: run `target/release/quiver fetch` (scripts/test does)")
    return p


def quiver_exe() -> Path:
    """The binary under test: $CARGO_TARGET_DIR/release/quiver, else target/release/quiver."""
    target = Path(os.environ.get("CARGO_TARGET_DIR") or ROOT / "target")
    if not target.is_absolute():
        target = ROOT / target
    return target / "release" / "quiver"


class Server:
    def __init__(self, *args: str, keys=(KEY,), model=None):
        exe = quiver_exe()
        assert exe.is_file(), f"{exe} is missing: cargo build --release"
        model = model or model_path()
        cmd = [str(exe), "serve", "-m", str(model), "--host", "127.0.0.1", "--port", "0", "-t", "2", *args]
        for k in keys:
            cmd += ["--api-key", k]
        self.key = keys[0] if keys else None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.stderr_lines = []
        self.url = None
        ready = threading.Event()

        def drain():
            for line in self.proc.stderr:
                self.stderr_lines.append(line)
                # A text log line or a JSON one (--log-format json): the URL ends at a quote.
                m = re.search(r"listening on (http://[^\s\"]+)", line)
                if m and self.url is None:
                    self.url = m.group(1)
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(60) or self.url is None:
            self.proc.kill()
            raise RuntimeError("quiver serve did not start:\n" + "".join(self.stderr_lines))
        self.model = self.get("/v1/models")["data"][0]["id"]

    def client(self, **kw):
        import openai

        kw.setdefault("api_key", self.key or "none")
        return openai.OpenAI(base_url=self.url + "/v1", max_retries=0, timeout=120, **kw)

    def request(self, method, path, body=None, headers=None, raw=None):
        h = {"Content-Type": "application/json"}
        if self.key:
            h["Authorization"] = f"Bearer {self.key}"
        h.update(headers or {})
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def get(self, path):
        status, _, body = self.request("GET", path)
        assert status == 200, body
        return json.loads(body)

    def metrics(self) -> dict:
        _, _, body = self.request("GET", "/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout=30.0):
        """Waits until nothing runs or waits and no KV block is held; returns the metrics."""
        t0 = time.time()
        while True:
            m = self.metrics()
            if m["quiver_requests_running"] == 0 and m["quiver_requests_waiting"] == 0 and m["quiver_kv_blocks_used"] == 0:
                return m
            if time.time() - t0 > timeout:
                return m
            time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="session")
def server():
    s = Server("--ctx-size", "1024", "--max-seqs", "16")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return server.client()
