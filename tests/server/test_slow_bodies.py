"""Slow bodies (docs/SERVER.md, "Limits"): connections whose headers are complete but whose body
trickles in are displaced at the connection cap like idle ones, so that they cannot lock out
clients that send whole requests. 127.0.0.1 only, bounded loops."""

import http.client
import json
import subprocess
import sys
import time

from conftest import Server

# 1,100 sockets sending a request's headers, then its body one byte every 2 s, reconnecting
# when the server closes them or answers: argv port, sockets, seconds. Prints "ready", then a
# JSON line of counts at the end.
ATTACKER = r"""
import json, resource, socket, sys, time
port, n, secs = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 512)), hard))
HEAD = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100000\r\n\r\n{")
def connect():
    try:
        s = socket.create_connection(("127.0.0.1", port), timeout=2)
        s.sendall(HEAD)
        s.setblocking(False)
        return s
    except OSError:
        return None
socks = [connect() for _ in range(n)]
print("ready", flush=True)
reconnects = 0
end = time.time() + secs
while time.time() < end:
    t0 = time.time()
    for i, s in enumerate(socks):
        alive = s is not None
        if alive:
            try:
                s.recv(65536)  # closed (b"") or answered (503, 408): either way, again
                alive = False
            except BlockingIOError:
                pass
            except OSError:
                alive = False
        if alive:
            try:
                s.send(b" ")
            except BlockingIOError:
                pass
            except OSError:
                alive = False
        if not alive:
            if s is not None:
                s.close()
            socks[i] = connect()
            reconnects += 1
    time.sleep(max(0.0, 2.0 - (time.time() - t0)))
print(json.dumps({"reconnects": reconnects}), flush=True)
"""


def _probe(port, path, body=None):
    t0 = time.perf_counter()
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        if body is None:
            c.request("GET", path)
        else:
            c.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        r = c.getresponse()
        r.read()
        return r.status, time.perf_counter() - t0
    except OSError as e:
        return repr(e), time.perf_counter() - t0
    finally:
        c.close()


def test_slow_bodies_cannot_lock_clients_out():
    """1,100 slow-body sockets against --max-connections 64: every whole request (/health, a
    small /tokenize) is answered 200 within a second while they trickle and reconnect."""
    s = Server("--ctx-size", "512", "--max-connections", "64", keys=())
    attacker = None
    try:
        port = int(s.url.rsplit(":", 1)[1])
        attacker = subprocess.Popen([sys.executable, "-c", ATTACKER, str(port), "1100", "12"],
                                    stdout=subprocess.PIPE, text=True)
        assert attacker.stdout.readline().strip() == "ready"
        small = json.dumps({"content": "hello"}).encode()
        probes = []
        t0 = time.time()
        while time.time() - t0 < 8:
            probes.append(_probe(port, "/health") if len(probes) % 2 == 0 else _probe(port, "/tokenize", small))
            time.sleep(0.1)
        out, _ = attacker.communicate(timeout=60)
        bad = [p for p in probes if p[0] != 200]
        lat = sorted(p[1] for p in probes)
        print(f"\n1,100 slow bodies, cap 64: {len(probes)} probes, {len(bad)} not 200, "
              f"max {lat[-1] * 1000:.0f} ms, median {lat[len(lat) // 2] * 1000:.0f} ms; attacker {out.strip()}")
        assert not bad, bad[:10]
        assert lat[-1] < 1.0, [round(x, 3) for x in lat[-5:]]
        m = s.metrics()
        assert m["quiver_connections_evicted_total"] >= 1000, m["quiver_connections_evicted_total"]
    finally:
        if attacker is not None and attacker.poll() is None:
            attacker.kill()
        assert s.stop() == 0
