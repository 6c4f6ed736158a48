import concurrent.futures as cf
import json
import signal
import threading
import time
import uuid

import openai
import pytest

from conftest import KEY, Server

PROMPT = [{"role": "user", "content": "Write a short poem about the sea."}]


def chat(client, model, messages=PROMPT, **kw):
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 12)
    return client.chat.completions.create(model=model, messages=messages, **kw)


def test_models_health_metrics(server):
    models = server.get("/v1/models")
    assert models["object"] == "list" and models["data"][0]["id"] == server.model
    assert server.get("/health")["status"] == "ok"
    m = server.metrics()
    for k in ["quiver_kv_blocks_used", "quiver_kv_blocks_free", "quiver_requests_running", "quiver_requests_waiting",
              "quiver_prompt_tokens_total", "quiver_generation_tokens_total", "quiver_prefix_cache_hit_tokens_total",
              "quiver_time_to_first_token_seconds_count", "quiver_inter_token_latency_seconds_count"]:
        assert k in m, k


def test_chat_non_streaming(server, client):
    r = chat(client, server.model)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == server.model
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 12 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_chat_streaming_matches_non_streaming(server, client):
    whole = chat(client, server.model, max_tokens=16)
    chunks = list(chat(client, server.model, max_tokens=16, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == whole.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    # The raw stream ends with data: [DONE].
    status, headers, body = server.request("POST", "/v1/chat/completions",
                                           {"messages": PROMPT, "max_tokens": 3, "stream": True, "temperature": 0})
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    events = [l for l in body.decode().split("\n") if l.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_max_tokens(server, client):
    # A prompt the model answers at length (greedy: "Once upon a time, in the land ..."), so
    # that the cap, not the end of the answer, stops it.
    msgs = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
    r = chat(client, server.model, msgs, max_tokens=5)
    assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
    r = chat(client, server.model, msgs, max_tokens=None, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3 and r.choices[0].finish_reason == "length"


def test_stop_strings(server, client):
    full = chat(client, server.model, max_tokens=24).choices[0].message.content
    words = full.split()
    assert len(words) >= 4, full
    stop = words[3]
    r = chat(client, server.model, max_tokens=24, stop=[stop, "\u2603never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]
    # Streaming gives the same text.
    text = "".join(ch.choices[0].delta.content or "" for ch in chat(client, server.model, max_tokens=24, stop=stop, stream=True) if ch.choices)
    assert text == full[: full.index(stop)]


def test_logprobs(server, client):
    r = chat(client, server.model, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token  # greedy: the best is the chosen one
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-4
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
    assert chat(client, server.model, max_tokens=2).choices[0].logprobs is None


def test_seed_reproducibility(server, client):
    kw = dict(temperature=1.0, top_p=0.95, max_tokens=16)
    a = chat(client, server.model, seed=1234, **kw).choices[0].message.content
    b = chat(client, server.model, seed=1234, **kw).choices[0].message.content
    assert a == b
    others = {chat(client, server.model, seed=s, **kw).choices[0].message.content for s in (1, 2, 3)}
    assert len(others | {a}) > 1


def test_completions_text_and_token_ids(server, client):
    r = client.completions.create(model=server.model, prompt="The capital of France is", max_tokens=5, temperature=0, logprobs=2)
    c = r.choices[0]
    assert r.object == "text_completion" and c.text and r.usage.completion_tokens == 5
    assert len(c.logprobs.tokens) == 5 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    _, _, body = server.request("POST", "/tokenize", {"prompt": "The capital of France is"})
    ids = json.loads(body)["tokens"]
    r2 = client.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0)
    assert r2.choices[0].text == c.text
    chunks = list(client.completions.create(model=server.model, prompt=ids, max_tokens=5, temperature=0, stream=True))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.text


def test_tokenize_detokenize(server):
    status, _, body = server.request("POST", "/tokenize", {"prompt": "Hello world", "add_special": False})
    t = json.loads(body)
    assert status == 200 and t["count"] == len(t["tokens"]) > 0
    status, _, body = server.request("POST", "/detokenize", {"tokens": t["tokens"]})
    assert status == 200 and json.loads(body)["prompt"] == "Hello world"
    status, _, body = server.request("POST", "/tokenize", {"messages": PROMPT})
    assert status == 200 and json.loads(body)["count"] > 5
    assert server.request("POST", "/detokenize", {"tokens": [10**9]})[0] == 400


def test_prefix_cache(server, client):
    system = f"Session {uuid.uuid4()}. " + " ".join(f"Rule {i}: answer politely and briefly, in English." for i in range(40))
    def ask(q):
        t0 = time.time()
        r = chat(client, server.model, [{"role": "system", "content": system}, {"role": "user", "content": q}], max_tokens=1)
        return r, time.time() - t0
    r1, t1 = ask("What is two plus two?")
    r2, t2 = ask("Name a colour.")
    assert r1.usage.prompt_tokens > 300
    assert r1.usage.prompt_tokens_details.cached_tokens == 0
    assert r2.usage.prompt_tokens_details.cached_tokens > 300
    assert server.metrics()["quiver_prefix_cache_hit_tokens_total"] > 300
    # With one output token the request time is the time to first token. The second request
    # prefills ~30 tokens instead of ~500: an order of magnitude apart, so this coarse
    # comparison holds on a noisy machine.
    assert t2 < t1, f"cached request took {t2:.3f}s, uncached {t1:.3f}s"


def test_concurrent_clients_match_solo_runs(server, client):
    topics = ["the sea", "a cat", "the moon", "bread", "rain", "a city", "music", "winter",
              "a river", "the sun", "a garden", "coffee", "trains", "a forest", "snow", "books"]
    reqs = []
    for i, t in enumerate(topics):
        kw = dict(max_tokens=6 + i % 5, temperature=0)
        if i % 3 == 1:
            kw["logprobs"], kw["top_logprobs"] = True, 2
        if i % 4 == 2:
            kw["frequency_penalty"] = 0.5
        if i % 5 == 3:
            kw["stop"] = ["\n\n"]
        reqs.append(([{"role": "user", "content": f"Tell me about {t}."}], kw))

    def run(r):
        out = chat(client, server.model, r[0], **r[1])
        lp = [(t.token, round(t.logprob, 3)) for t in out.choices[0].logprobs.content] if out.choices[0].logprobs else None
        return out.choices[0].message.content, out.choices[0].finish_reason, out.usage.completion_tokens, lp

    solo = [run(r) for r in reqs]
    with cf.ThreadPoolExecutor(16) as ex:
        together = list(ex.map(run, reqs))
    for i, (a, b) in enumerate(zip(solo, together)):
        assert a[:3] == b[:3], f"request {i}: alone {a} vs together {b}"
        if a[3]:
            assert [t for t, _ in a[3]] == [t for t, _ in b[3]]
            assert all(abs(x - y) < 0.05 for (_, x), (_, y) in zip(a[3], b[3]))


def test_disconnect_frees_blocks(server, client):
    base = server.wait_idle()
    assert base["quiver_kv_blocks_used"] == 0
    stream = chat(client, server.model, [{"role": "user", "content": "Write a very long story about dragons."}],
                  max_tokens=800, stream=True, extra_body={"ignore_eos": True})
    n = 0
    for ch in stream:
        n += 1
        if n == 5:
            break
    assert server.metrics()["quiver_kv_blocks_used"] > 0
    stream.close()
    after = server.wait_idle(timeout=15)
    assert after["quiver_kv_blocks_used"] == 0 and after["quiver_requests_running"] == 0
    assert after["quiver_generation_tokens_total"] - base["quiver_generation_tokens_total"] < 400


def err(server, path, body=None, raw=None, headers=None, method="POST"):
    status, h, b = server.request(method, path, body, raw=raw, headers=headers)
    e = json.loads(b)["error"]
    assert set(e) >= {"message", "type", "param", "code"}
    return status, e, h


def test_errors(server):
    msgs = [{"role": "user", "content": "hi"}]
    s, e, _ = err(server, "/v1/chat/completions", raw=b"{not json")
    assert s == 400 and "JSON" in e["message"]
    for body, param in [
        ({"messages": msgs, "temperature": 5}, "temperature"),
        ({"messages": msgs, "top_p": "x"}, "top_p"),
        ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
        ({"messages": msgs, "n": 17}, "n"),
        ({"messages": msgs, "stop": 3}, "stop"),
        ({"messages": msgs, "logit_bias": {"x": 1}}, "logit_bias"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ]:
        s, e, _ = err(server, "/v1/chat/completions", body)
        assert s == 400 and e["param"] == param, (body, e)
    s, e, _ = err(server, "/v1/completions", {"prompt": [1, 2, 10**9]})
    assert s == 400 and e["param"] == "prompt"
    # Longer than the context: 400 naming both lengths.
    long_text = "hello " * 1500
    s, e, _ = err(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]})
    assert s == 400 and "1024" in e["message"] and e["code"] == "context_length_exceeded"
    n = json.loads(server.request("POST", "/tokenize", {"messages": [{"role": "user", "content": long_text}]})[2])["count"]
    assert str(n) in e["message"]
    s, e, _ = err(server, "/v1/completions", {"prompt": "hi", "max_tokens": 5000})
    assert s == 400 and "1024" in e["message"] and "5000" in e["message"]
    # Any model name is served (test_drop_in.py); a model looked up by id must be the one.
    s, e, _ = err(server, "/v1/models/no-such-model", method="GET")
    assert s == 404 and e["code"] == "model_not_found"
    s, e, _ = err(server, "/v1/nothing-here", {})
    assert s == 404
    s, e, _ = err(server, "/v1/chat/completions", raw=b'{"messages": "' + b"x" * (9 << 20) + b'"}')
    assert s == 413


def test_errors_through_openai_client(server, client):
    with pytest.raises(openai.BadRequestError) as ei:
        chat(client, server.model, temperature=9)
    assert ei.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_api_keys(server):
    msgs = [{"role": "user", "content": "hi"}]
    s, e, _ = err(server, "/v1/chat/completions", {"messages": msgs}, headers={"Authorization": "Bearer wrong"})
    assert s == 401 and e["code"] == "invalid_api_key"
    s, e, _ = err(server, "/v1/models", headers={"Authorization": ""}, method="GET")
    assert s == 401
    with pytest.raises(openai.AuthenticationError):
        chat(server.client(api_key="wrong"), server.model)
    assert server.request("GET", "/health", headers={"Authorization": ""})[0] == 200
    m = server.metrics()
    assert m['quiver_http_requests_total{route="/v1/chat/completions",status="401"}'] >= 1


def test_load(server, client):
    base = server.wait_idle()
    assert base["quiver_kv_blocks_used"] == 0
    n_req = 500

    def one(i):
        if i % 4 == 0:
            r = client.completions.create(model=server.model, prompt=f"Number {i} is", max_tokens=3, temperature=0.5, seed=i)
            return r.choices[0].finish_reason
        r = chat(client, server.model, [{"role": "user", "content": f"Say the number {i}."}], max_tokens=3,
                 temperature=0.7, seed=i, stream=(i % 3 == 0))
        if i % 3 == 0:
            return [ch.choices[0].finish_reason for ch in r if ch.choices and ch.choices[0].finish_reason][0]
        return r.choices[0].finish_reason

    with cf.ThreadPoolExecutor(32) as ex:
        results = list(ex.map(one, range(n_req)))
    assert len(results) == n_req and all(r in ("stop", "length") for r in results)
    after = server.wait_idle()
    assert after["quiver_kv_blocks_used"] == base["quiver_kv_blocks_used"] == 0
    assert after["quiver_requests_running"] == 0 and after["quiver_requests_waiting"] == 0
    assert after.get('quiver_http_requests_total{route="/v1/chat/completions",status="500"}', 0) == 0


def test_queue_full_is_429():
    s = Server("--ctx-size", "512", "--max-seqs", "1", "--max-waiting", "1", keys=())
    try:
        def one(_):
            st, h, b = s.request("POST", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True})
            return st, h.get("Retry-After") or h.get("retry-after"), b
        with cf.ThreadPoolExecutor(8) as ex:
            res = list(ex.map(one, range(8)))
        codes = [r[0] for r in res]
        assert 429 in codes and 200 in codes, codes
        for st, ra, b in res:
            if st == 429:
                assert ra == "1" and json.loads(b)["error"]["type"] == "rate_limit_error"
        # No key configured: no authentication needed.
        assert s.request("GET", "/v1/models")[0] == 200
    finally:
        assert s.stop() == 0


def test_sigterm_shutdown_exits_zero():
    s = Server("--ctx-size", "512", "--shutdown-grace", "2", keys=())
    got = {}

    def stream():
        try:
            st, _, body = s.request("POST", "/v1/chat/completions", {
                "messages": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True})
            got["status"], got["body"] = st, body.decode()
        except Exception as e:  # the connection may be closed under it
            got["error"] = repr(e)

    t = threading.Thread(target=stream)
    t.start()
    time.sleep(1.0)
    t0 = time.time()
    assert s.stop(signal.SIGTERM) == 0
    assert time.time() - t0 < 15
    t.join(10)
    assert "shutting down" in "".join(s.stderr_lines)
    if "body" in got:
        assert got["body"].rstrip().endswith("data: [DONE]")
