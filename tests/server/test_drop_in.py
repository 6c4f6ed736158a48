"""What clients written for other servers send, against the real SmolLM2 server: any model name
(the answer names the served model), the routes without `/v1` (as llama-server serves them),
`/v1/completions` with a list of prompts (each prompt its choices, in order; with `n`,
prompts × n), and `/completion`'s `n_probs` (llama-server's `completion_probabilities`)."""

import json
import math

import pytest

MSGS = [{"role": "user", "content": "Name a colour."}]


def post(server, path, body):
    s, _, b = server.request("POST", path, body)
    assert s == 200, (path, s, b)
    return json.loads(b)


def sse(server, path, body):
    s, _, b = server.request("POST", path, body)
    assert s == 200, (path, s, b)
    lines = [l[len("data: "):] for l in b.decode().splitlines() if l.startswith("data: ")]
    return [json.loads(l) for l in lines if l != "[DONE]"], lines[-1]


def test_any_model_name_is_served(server, client):
    ref = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "temperature": 0})
    for name in ["gpt-4o-mini", "claude-3-5-sonnet", ""]:
        r = client.chat.completions.create(model=name, messages=MSGS, max_tokens=8, temperature=0)
        assert r.model == server.model and r.choices[0].message.content == ref["choices"][0]["message"]["content"]
    r = client.completions.create(model="text-davinci-003", prompt="Hello", max_tokens=2)
    assert r.model == server.model
    e = client.embeddings.create(model="text-embedding-3-small", input="hi")
    assert e.model == server.model and len(e.data[0].embedding) > 0
    r = post(server, "/completion", {"model": "gpt-4", "prompt": "Hello", "n_predict": 2})
    assert r["model"] == server.model


def test_routes_without_v1(server):
    ref = post(server, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "temperature": 0})
    r = post(server, "/chat/completions", {"messages": MSGS, "max_tokens": 8, "temperature": 0})
    assert r["object"] == "chat.completion" and r["choices"][0]["message"] == ref["choices"][0]["message"]
    r = post(server, "/completions", {"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r["object"] == "text_completion"
    assert server.get("/models")["data"][0]["id"] == server.model
    assert server.get(f"/models/{server.model}")["id"] == server.model
    # `/embeddings` is llama-server's own shape there, as llama-server answers it.
    r = post(server, "/embeddings", {"input": "hi"})
    assert isinstance(r, list) and r[0]["index"] == 0
    assert post(server, "/messages", {"max_tokens": 2, "messages": MSGS})["type"] == "message"
    assert post(server, "/responses", {"input": "hi", "max_output_tokens": 2})["object"] == "response"


PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


def test_a_list_of_prompts(server, client):
    singles = [client.completions.create(model="m", prompt=p, max_tokens=6, temperature=0) for p in PROMPTS]
    r = client.completions.create(model="m", prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles]
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    # With n: prompts × n choices, prompt i's at i × n + j (greedy: all alike).
    r = client.completions.create(model="m", prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    # Token ids, echo.
    ids = [json.loads(server.request("POST", "/tokenize", {"prompt": p})[2])["tokens"] for p in PROMPTS[:2]]
    r = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in r.choices] == [p + s.choices[0].text for p, s in zip(PROMPTS[:2], singles)]
    # Streamed: each index's text, one usage chunk, [DONE].
    chunks, last = sse(server, "/v1/completions", {"prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "n": 2,
                                                   "stream": True, "stream_options": {"include_usage": True}})
    assert last == "[DONE]"
    texts = {}
    for c in chunks:
        for ch in c["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {i: singles[i // 2].choices[0].text for i in range(6)}
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == 1 and usage[0]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles)
    assert usage[0]["completion_tokens"] == 2 * sum(s.usage.completion_tokens for s in singles)
    # Refused: a list mixing prompts and ids, too many choices.
    for body in [{"prompt": ["a", 5]}, {"prompt": ["a"] * 129, "n": 2}]:
        s, _, b = server.request("POST", "/v1/completions", body)
        assert s == 400 and json.loads(b)["error"]["param"] == "prompt", b


def test_n_probs(server, client):
    prompt = "The capital of France is"
    r = post(server, "/completion", {"prompt": prompt, "n_predict": 5, "temperature": 0, "n_probs": 3})
    probs = r["completion_probabilities"]
    assert len(probs) == r["tokens_predicted"] == 5
    ref = client.completions.create(model="m", prompt=prompt, max_tokens=5, temperature=0, logprobs=3)
    lp = ref.choices[0].logprobs
    assert "".join(p["token"] for p in probs) == r["content"] == ref.choices[0].text
    for p, want, tops in zip(probs, lp.token_logprobs, lp.top_logprobs):
        assert set(p) == {"id", "token", "bytes", "logprob", "top_logprobs"}
        assert bytes(p["bytes"]).decode() == p["token"]
        assert math.isclose(p["logprob"], want, abs_tol=1e-4)
        top = p["top_logprobs"]
        assert len(top) == 3 and top[0]["id"] == p["id"]
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        assert {t["token"]: pytest.approx(t["logprob"], abs=1e-4) for t in top} == tops
    # Streamed: each token's chunk carries its entry.
    chunks, _ = sse(server, "/completion", {"prompt": prompt, "n_predict": 5, "temperature": 0, "n_probs": 2, "stream": True})
    entries = [e for c in chunks if not c["stop"] for e in c["completion_probabilities"]]
    assert [e["id"] for e in entries] == [p["id"] for p in probs]
    assert "completion_probabilities" not in post(server, "/completion", {"prompt": prompt, "n_predict": 2})
    for body, param in [({"prompt": "hi", "n_probs": 21}, "n_probs"), ({"prompt": "hi", "n_probs": "x"}, "n_probs"),
                        ({"prompt": "hi", "n_probs": 2, "post_sampling_probs": True}, "post_sampling_probs")]:
        s, _, b = server.request("POST", "/completion", body)
        assert s == 400 and json.loads(b)["error"]["param"] == param, b
