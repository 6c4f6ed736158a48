"""Caps on what one request can make the server do (docs/SERVER.md, "Limits"): a body announced
past the limit is refused before it is sent, `/detokenize` answers in proportion to what it is
asked, and `cache_salt` (or `--cache-isolation key`) keeps tenants' prefix caches apart."""

import json
import socket
import time
import uuid

from conftest import Server


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


def cached(server, path, body, salt=None, key=None):
    """The cached prompt tokens a one-token request reports (`usage.prompt_tokens_details`, or
    `tokens_cached` on llama-server's /completion)."""
    limit = {"/completion": "n_predict", "/v1/responses": "max_output_tokens"}.get(path, "max_tokens")
    body = {**body, limit: 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    headers = {"Authorization": f"Bearer {key}"} if key else None
    s, _, resp = server.request("POST", path, body, headers=headers)
    assert s == 200, (path, s, resp[:300])
    r = json.loads(resp)
    if path == "/completion":
        return r["tokens_cached"]
    if path == "/v1/responses":
        return r["usage"]["input_tokens_details"]["cached_tokens"]
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def long_prompt():
    return f"Session {uuid.uuid4()}. " + " ".join(f"Rule {i}: answer politely and briefly." for i in range(20))


def test_cache_salt_keeps_tenants_apart(server):
    """Requests with different `cache_salt`s (or one without) share no prefix-cache blocks, so
    `cached_tokens` cannot tell one tenant another's prompt; the same salt shares as before."""
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "system", "content": long_prompt()},
                                               {"role": "user", "content": "Hi"}]}),
        ("/v1/completions", {"prompt": long_prompt()}),
        ("/completion", {"prompt": long_prompt()}),
        ("/v1/responses", {"instructions": long_prompt(), "input": "Hi"}),
    ]:
        assert cached(server, path, body, salt="tenant-a") == 0, path
        assert cached(server, path, body, salt="tenant-b") == 0, path
        assert cached(server, path, body) == 0, path
        assert cached(server, path, body, salt="tenant-a") > 100, path
        assert cached(server, path, body, salt="tenant-b") > 100, path
        assert cached(server, path, body) > 100, path


def test_a_bad_cache_salt_is_a_400_naming_it(server):
    for salt in ["", "x" * 1025, 7, ["a"], {"a": 1}]:
        s, _, resp = server.request("POST", "/v1/completions",
                                    {"prompt": "hi", "max_tokens": 1, "cache_salt": salt})
        e = json.loads(resp)["error"]
        assert s == 400 and e["param"] == "cache_salt", (salt, s, e)
    assert cached(server, "/v1/completions", {"prompt": "hi"}, salt="x" * 1024) == 0


def test_cache_isolation_by_key():
    """`--cache-isolation key`: each API key its own prefix cache (a salt within it is a
    namespace of its own too); requests with the same key and salt share as before."""
    s = Server("--ctx-size", "512", "--cache-isolation", "key", keys=("key-one", "key-two"))
    try:
        body = {"prompt": long_prompt()}
        path = "/v1/completions"
        assert cached(s, path, body, key="key-one") == 0
        assert cached(s, path, body, key="key-two") == 0
        assert cached(s, path, body, key="key-one") > 100
        assert cached(s, path, body, key="key-two") > 100
        assert cached(s, path, body, key="key-two", salt="s") == 0
        assert cached(s, path, body, key="key-one", salt="s") == 0
        assert cached(s, path, body, key="key-one", salt="s") > 100
        chat = {"messages": [{"role": "system", "content": long_prompt()}, {"role": "user", "content": "Hi"}]}
        assert cached(s, "/v1/chat/completions", chat, key="key-two") == 0
        assert cached(s, "/v1/chat/completions", chat, key="key-one") == 0
        assert cached(s, "/v1/chat/completions", chat, key="key-two") > 100

        # Anthropic's Messages, the key as `x-api-key`: the same namespaces.
        def messages_cached(key):
            body = {"model": "m", "max_tokens": 1, "system": long_system,
                    "messages": [{"role": "user", "content": "Hi"}]}
            st, _, resp = s.request("POST", "/v1/messages", body, headers={"Authorization": "", "x-api-key": key})
            assert st == 200, resp[:300]
            return json.loads(resp)["usage"]["cache_read_input_tokens"]
        long_system = long_prompt()
        assert messages_cached("key-one") == 0
        assert messages_cached("key-two") == 0
        assert messages_cached("key-one") > 100
    finally:
        s.stop()


def test_a_deeply_nested_grammar_is_a_400_not_a_crash(server):
    """5,000 nested groups in a GBNF grammar overflowed the request thread's stack and aborted
    the server; nesting is bounded, and the server goes on answering."""
    for n in [5000, 201]:
        g = "root ::= " + "(" * n + '"a"' + ")" * n
        s, _, resp = server.request("POST", "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "grammar": g})
        e = json.loads(resp)["error"]
        assert s == 400 and e["param"] == "grammar" and "nested" in e["message"], (n, s, e["message"][:200])
    s, _, _ = server.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    assert s == 200
