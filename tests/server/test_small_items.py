"""The small defects of the attack review: auth scheme case, 405 bodies, parameter messages,
an empty API key, and shutdown (503 during the grace, a second signal ends it)."""

import json
import signal
import subprocess
import threading
import time

from conftest import KEY, Server, model_path, quiver_exe

PROMPT = [{"role": "user", "content": "Write a long story about the sea."}]


def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("Bearer", "bearer", "BEARER"):
        status, _, _ = server.request("GET", "/v1/models", headers={"Authorization": f"{scheme} {KEY}"})
        assert status == 200, scheme
    status, _, _ = server.request("GET", "/v1/models", headers={"Authorization": f"Basic {KEY}"})
    assert status == 401


def test_405_has_the_openai_error_shape(server):
    status, _, body = server.request("GET", "/v1/chat/completions")
    e = json.loads(body)["error"]
    assert status == 405 and e["code"] == "method_not_allowed" and "GET" in e["message"]


def test_n_zero_says_at_least_one(server):
    status, _, body = server.request("POST", "/v1/chat/completions", {"messages": PROMPT, "n": 0})
    e = json.loads(body)["error"]
    assert status == 400 and e["param"] == "n"
    assert "at least 1" in e["message"] and "18446744073709551615" not in e["message"]


def test_an_empty_api_key_is_refused_at_start():
    p = subprocess.run(
        [str(quiver_exe()), "serve", "-m", str(model_path()), "--port", "0", "--api-key", ""],
        capture_output=True, text=True, timeout=60,
    )
    assert p.returncode != 0
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and "empty" in lines[0], p.stderr


def test_shutdown_answers_503_during_the_grace_and_a_second_signal_ends_it():
    s = Server("--ctx-size", "2048", "--shutdown-grace", "30", keys=())
    got = {}

    def stream():
        try:
            got["status"], _, body = s.request("POST", "/v1/chat/completions", {
                "messages": PROMPT, "max_tokens": 2000, "stream": True, "ignore_eos": True})
            got["body"] = body.decode()
        except Exception as e:  # the connection may close under it
            got["error"] = repr(e)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    # The running stream goes on; new work is refused with the documented 503.
    status, _, body = s.request("POST", "/v1/chat/completions", {"messages": PROMPT, "max_tokens": 4})
    assert status == 503 and json.loads(body)["error"]["code"] == "shutting_down"
    assert s.request("GET", "/health")[0] == 503
    assert s.proc.poll() is None, "the grace is 30 s: still running"
    # A second SIGTERM aborts what runs and exits well before the 30 s grace.
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(15) == 0
    assert time.time() - t0 < 10
    t.join(10)
    if "body" in got:
        assert got["body"].rstrip().endswith("data: [DONE]")
