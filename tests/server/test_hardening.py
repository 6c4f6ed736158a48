"""Limits that keep one client from starving the others (docs/SERVER.md, "Limits"): the prompt
work off the HTTP workers and bounded, connection timeouts and a connection cap, bounded stop
strings. Every test talks to 127.0.0.1 only, with bounded loops."""

import json
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
