"""Limits that keep one client from starving the others (docs/SERVER.md, "Limits"): the prompt
work off the HTTP workers and bounded, connection timeouts and a connection cap, bounded stop
strings. Every test talks to 127.0.0.1 only, with bounded loops."""

import http.client
import json
import socket
import subprocess
import sys
import threading
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
    and a small /tokenize keep answering within 100 ms meanwhile. A blocked server fails every
    attempt; a machine busy with other work may stall one probe once, so a second attempt runs
    before the latency fails the test."""
    s = Server("--ctx-size", "1024", keys=())
    try:
        port = int(s.url.rsplit(":", 1)[1])
        small = json.dumps({"prompt": "hello"}).encode()
        base = [_probe(port, "/health")[1] for _ in range(20)]
        assert _probe(port, "/tokenize", small)[0] == 200
        for attempt in range(2):
            lat = _big_prompt_round(port, small)
            print(f" (idle: max {max(base) * 1000:.1f} ms)")
            if lat[-1] < 0.100:
                break
        assert lat[-1] < 0.100, [round(x * 1000, 1) for x in lat[-5:]]
    finally:
        assert s.stop() == 0


def _big_prompt_round(port, small):
    """One round of test_big_prompts_do_not_block_the_server: the responses checked, the probes'
    latencies (seconds, sorted) returned."""
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
          f"max {lat[-1] * 1000:.1f} ms", end="")
    return lat


def _metrics(port):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request("GET", "/metrics")
        out = {}
        for line in c.getresponse().read().decode().splitlines():
            if line and not line.startswith("#"):
                k, v = line.rsplit(" ", 1)
                out[k] = float(v)
        return out
    finally:
        c.close()


def _closed(sock) -> bool:
    """Whether the server closed `sock` (reads and drops anything it sent first)."""
    sock.setblocking(False)
    try:
        while True:
            data = sock.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _open_sockets(port, n_idle, n_half):
    socks = []
    for i in range(n_idle + n_half):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if i >= n_idle:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le")
        socks.append(s)
    return socks


def _wait_closed(socks, timeout):
    t0 = time.time()
    open_ = list(socks)
    while open_ and time.time() - t0 < timeout:
        open_ = [s for s in open_ if not _closed(s)]
        time.sleep(0.05)
    return open_, time.time() - t0


def test_idle_and_half_sent_connections_are_capped_and_timed_out():
    s = Server("--ctx-size", "512", "--max-connections", "64", "--timeout-read-secs", "2",
               "--timeout-idle-secs", "3", keys=())
    socks = []
    try:
        port = int(s.url.rsplit(":", 1)[1])
        # A stream in progress all along: busy connections are never evicted.
        got = {}

        def stream():
            st, _, body = s.request("POST", "/v1/chat/completions", {
                "messages": MSGS, "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0})
            got["status"], got["body"] = st, body.decode()

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(0.3)

        # 300 idle and half-sent connections against a cap of 64.
        socks = _open_sockets(port, 150, 150)
        lat = []
        for _ in range(20):
            st, dt = _probe(port, "/health")
            assert st == 200
            lat.append(dt)
            time.sleep(0.01)
        print(f"\n300 idle/half-sent connections, cap 64: /health max {max(lat) * 1000:.1f} ms, "
              f"median {sorted(lat)[10] * 1000:.1f} ms")
        assert max(lat) < 0.100, [round(x * 1000, 1) for x in sorted(lat)[-5:]]
        m = _metrics(port)
        assert m["quiver_connections_open"] <= 64 and m["quiver_connections_max"] == 64
        assert m["quiver_connections_evicted_total"] >= 300 - 64

        # Every one of them is closed by the server within the read timeout (2 s) and slack.
        left, waited = _wait_closed(socks, 2 + 3)
        assert not left, f"{len(left)} of 300 still open after {waited:.1f}s"
        t.join(60)
        assert got.get("status") == 200 and got["body"].rstrip().endswith("data: [DONE]"), got
        m = _metrics(port)
        assert m["quiver_connections_timed_out_total"] >= 1
        assert m["quiver_connections_open"] <= 2, m["quiver_connections_open"]
        for x in socks:
            x.close()

        # Under the cap: nothing is evicted; the read timeout closes them, not before.
        before = _metrics(port)["quiver_connections_timed_out_total"]
        socks = _open_sockets(port, 10, 10)
        time.sleep(1.0)
        assert not any(_closed(x) for x in socks), "closed before the read timeout"
        left, waited = _wait_closed(socks, 1 + 3)
        assert not left, f"{len(left)} of 20 still open after {waited + 1:.1f}s"
        assert _metrics(port)["quiver_connections_timed_out_total"] - before >= 20
    finally:
        for x in socks:
            x.close()
        assert s.stop() == 0


def test_keep_alive_idle_timeout_and_slow_body():
    s = Server("--ctx-size", "512", "--timeout-read-secs", "2", "--timeout-idle-secs", "3", keys=())
    try:
        port = int(s.url.rsplit(":", 1)[1])
        # Keep-alive: a second request after 1.5 s on the same connection is served; after the
        # idle timeout the server closes the connection.
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and r.read()
        time.sleep(1.5)
        c.request("GET", "/health")
        r = c.getresponse()
        assert r.status == 200 and r.read()
        sock = c.sock
        time.sleep(1.5)
        assert not _closed(sock), "closed before the idle timeout"
        left, waited = _wait_closed([sock], 3 + 2)
        assert not left, f"keep-alive connection still open {waited + 1.5:.1f}s after its last request"
        c.close()

        # A body that does not arrive: 408 after the read timeout, then the connection closes.
        raw = socket.create_connection(("127.0.0.1", port), timeout=10)
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        t0 = time.time()
        data = b""
        while True:
            chunk = raw.recv(65536)
            if not chunk:
                break
            data += chunk
        took = time.time() - t0
        raw.close()
        head, _, body = data.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), data
        e = json.loads(body)["error"]
        assert e["code"] == "request_timeout" and e["type"] == "invalid_request_error"
        assert 1.5 < took < 6, took
    finally:
        assert s.stop() == 0


def test_at_the_cap_with_every_connection_busy_new_ones_get_503():
    s = Server("--ctx-size", "512", "--max-connections", "2", keys=())
    try:
        port = int(s.url.rsplit(":", 1)[1])
        started = [threading.Event(), threading.Event()]
        results = []

        def stream(i):
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("POST", "/v1/chat/completions", body=json.dumps({
                "messages": MSGS, "max_tokens": 120, "ignore_eos": True, "stream": True}).encode(),
                headers={"Content-Type": "application/json"})
            r = c.getresponse()
            started[i].set()
            results.append((r.status, r.read().decode()))
            c.close()

        ts = [threading.Thread(target=stream, args=(i,)) for i in range(2)]
        for t in ts:
            t.start()
        assert all(e.wait(30) for e in started)
        st, h, body = None, None, b""
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            c.request("GET", "/health")
            r = c.getresponse()
            st, h, body = r.status, dict(r.getheaders()), r.read()
        finally:
            c.close()
        assert st == 503, (st, body)
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert (h.get("retry-after") or h.get("Retry-After")) == "1"
        for t in ts:
            t.join(120)
        assert [r[0] for r in results] == [200, 200]
        assert all(r[1].rstrip().endswith("data: [DONE]") for r in results)
        # Room again.
        assert _probe(port, "/health")[0] == 200
        assert _metrics(port)["quiver_connections_rejected_total"] >= 1
    finally:
        assert s.stop() == 0
