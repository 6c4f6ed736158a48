"""Caps on what one request can make the server do (docs/SERVER.md, "Limits"): a body announced
past the limit is refused before it is sent, `/detokenize` answers in proportion to what it is
asked, and a field the server cannot honour is refused rather than ignored."""

import json
import socket
import time


def test_a_huge_content_length_is_refused_up_front(server):
    """A 100 GB `Content-Length`: 413 at once, from the headers (it used to wait for the body
    until the read timeout, then 408)."""
    raw = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=5)
    try:
        t0 = time.time()
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    b"Authorization: Bearer " + server.key.encode() + b"\r\n"
                    b"Content-Length: 100000000000\r\n\r\n{\"prompt\": ")
        data = b""
        while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < 20:
            chunk = raw.recv(65536)
            if not chunk:
                break
            data += chunk
        took = time.time() - t0
    finally:
        raw.close()
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), data[:300]
    assert b"connection: close" in head.lower(), head
    e = json.loads(body)["error"]
    assert "8388608" in e["message"] or "8 MiB" in e["message"], e
    assert took < 2, took


def test_detokenize_answers_in_proportion_to_the_request(server):
    """Ids of the longest tokens, repeated: refused when their text would outgrow the request
    many times over; a sequence of ordinary length is answered."""
    _, _, body = server.request("POST", "/tokenize", {"content": "Hello world, how are you today?"})
    ids = json.loads(body)["tokens"]
    s, _, body = server.request("POST", "/detokenize", {"tokens": ids})
    assert s == 200 and json.loads(body)["content"] == "Hello world, how are you today?", body
    # SmolLM2's longest tokens are runs of spaces or dashes; find a long one by decoding.
    longest = max(range(0, 49152, 7), key=lambda i: len(json.loads(
        server.request("POST", "/detokenize", {"tokens": [i]})[2])["content"].encode()))
    n = 400_000
    req = json.dumps({"tokens": [longest] * n}).encode()
    s, _, body = server.request("POST", "/detokenize", raw=req)
    assert s == 400, (s, body[:200])
    e = json.loads(body)["error"]
    assert e["param"] == "tokens", e
    # A context's worth of them is fine.
    s, _, body = server.request("POST", "/detokenize", {"tokens": [longest] * 1024})
    assert s == 200, body[:200]


def test_cache_salt_is_refused_not_ignored(server):
    """vLLM's `cache_salt` asks for a prefix cache of its own; until the engine can give one,
    it is a 400 naming the field, never silently shared."""
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})]:
        s, _, resp = server.request("POST", path, {**body, "max_tokens": 1, "cache_salt": "tenant-a"})
        e = json.loads(resp)["error"]
        assert s == 400 and e["param"] == "cache_salt", (path, s, e)
