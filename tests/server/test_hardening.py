"""Limits that keep one client from starving the others (docs/SERVER.md, "Limits"): the prompt
work off the HTTP workers and bounded, connection timeouts and a connection cap, bounded stop
strings. Every test talks to 127.0.0.1 only, with bounded loops."""

import http.client
import json
import subprocess
import sys
import time

from conftest import Server

MSGS = [{"role": "user", "content": "Say hi."}]


def error_of(resp):
    status, _, body = resp
    e = json.loads(body)["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    return status, e


def test_stop_strings_are_bounded(server):
    url = "/v1/chat/completions"
    # Seven 1 MB stop strings: refused at once, naming the limit.
    t0 = time.time()
    s, e = error_of(server.request("POST", url, {"messages": MSGS, "stop": ["x" * 1_000_000] * 7}))
    assert s == 400 and e["param"] == "stop" and e["type"] == "invalid_request_error"
    assert "256 bytes" in e["message"] and "1000000" in e["message"], e
    assert time.time() - t0 < 5
    # One string over the limit (bytes, not characters: "é" is two bytes).
    s, e = error_of(server.request("POST", "/v1/completions", {"prompt": "hi", "stop": "é" * 129}))
    assert s == 400 and e["param"] == "stop" and "258 bytes" in e["message"], e
    # Too many.
    s, e = error_of(server.request("POST", url, {"messages": MSGS, "stop": [str(i) for i in range(17)]}))
    assert s == 400 and e["param"] == "stop" and "16" in e["message"], e
    # At the limits: accepted.
    st, _, body = server.request("POST", url, {"messages": MSGS, "max_tokens": 2, "temperature": 0,
                                               "stop": ["é" * 128] + [f"zz{i}" for i in range(15)]})
    assert st == 200, body


def _probe(port, path, body=None):
    """One request on a fresh connection: (status, seconds)."""
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        if body is None:
            c.request("GET", path)
        else:
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - t0
    finally:
        c.close()


# Sends big prompts from another process, so that the probes below measure the server and not
# this interpreter's lock: argv port, senders, rounds; prints one JSON line per response.
BIG_SENDER = r"""
import http.client, json, sys, threading
port, senders, rounds = (int(a) for a in sys.argv[1:4])
content = ("lorem ipsum dolor sit amet, " * 300_000)[:8_000_000]
bodies = [("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 4}).encode()),
          ("/v1/completions", json.dumps({"prompt": content, "max_tokens": 4}).encode())]
assert all(len(b) < 8 << 20 for _, b in bodies)  # under the body limit: not a 413
lock = threading.Lock()
print("ready", flush=True)
sys.stdin.readline()
def send(i):
    for _ in range(rounds):
        path, body = bodies[i % 2]
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
            r = c.getresponse()
            out = {"path": path, "status": r.status, "body": r.read().decode()}
            c.close()
        except Exception as e:
            out = {"path": path, "error": repr(e)}
        with lock:
            print(json.dumps(out), flush=True)
ts = [threading.Thread(target=send, args=(i,)) for i in range(senders)]
for t in ts:
    t.start()
for t in ts:
    t.join()
"""


def test_big_prompts_do_not_block_the_server():
    """8 concurrent ~8 MB prompts, 3 rounds: each gets a 400 context_length_exceeded, and /health
    and a small /tokenize keep answering within 100 ms meanwhile."""
    s = Server("--ctx-size", "1024", keys=())
    try:
        port = int(s.url.rsplit(":", 1)[1])
        small = json.dumps({"prompt": "hello"}).encode()
        base = [_probe(port, "/health")[1] for _ in range(20)]
        assert _probe(port, "/tokenize", small)[0] == 200
        p = subprocess.Popen([sys.executable, "-c", BIG_SENDER, str(port), "8", "3"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert p.stdout.readline().strip() == "ready"
            t0 = time.perf_counter()
            p.stdin.write("go\n")
            p.stdin.flush()
            probes = []
            while (p.poll() is None or len(probes) < 20) and len(probes) < 2000:
                st, dt = _probe(port, "/health") if len(probes) % 2 == 0 else _probe(port, "/tokenize", small)
                assert st == 200
                probes.append(dt)
                time.sleep(0.005)
            window = time.perf_counter() - t0
            out, _ = p.communicate(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
        results = [json.loads(line) for line in out.splitlines() if line.strip()]
        assert len(results) == 24, results
        for r in results:
            assert "error" not in r, r
            e = json.loads(r["body"])["error"]
            assert r["status"] == 400 and e["code"] == "context_length_exceeded", (r["path"], r["status"], e)
            assert e["type"] == "invalid_request_error" and "1024" in e["message"]
            assert e["param"] == ("messages" if "chat" in r["path"] else "prompt")
        lat = sorted(probes)
        print(f"\nbig prompts: {window:.2f}s, {len(probes)} probes, median {lat[len(lat) // 2] * 1000:.1f} ms, "
              f"max {lat[-1] * 1000:.1f} ms (idle: max {max(base) * 1000:.1f} ms)")
        assert lat[-1] < 0.100, [round(x * 1000, 1) for x in lat[-5:]]
    finally:
        assert s.stop() == 0
