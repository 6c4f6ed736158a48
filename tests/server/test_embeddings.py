"""Embeddings: OpenAI's `/v1/embeddings` through the official client (floats and base64, one or
many inputs, token ids) and llama-server's `/embedding`; bad requests are 400s naming the
field. (That the vectors are the model's pooled hidden states is the engine test
crates/engine/tests/embed.rs; here: the HTTP shapes and the agreement between forms.)"""

import base64
import json
import math
import struct


def unit(v):
    return abs(math.sqrt(sum(x * x for x in v)) - 1.0) < 1e-4


def test_embeddings_openai_and_llama_server_forms(server, client):
    texts = ["The cat sat on the mat.", "Quantum chromodynamics describes quarks.", "The cat sat on the mat."]
    r = client.embeddings.create(model="smollm2-135m", input=texts)
    assert [d.index for d in r.data] == [0, 1, 2]
    v = [d.embedding for d in r.data]
    assert len(v[0]) == 576 and all(unit(x) for x in v)
    assert v[0] == v[2] and v[0] != v[1]
    assert r.usage.prompt_tokens == r.usage.total_tokens > 10
    one = client.embeddings.create(model="smollm2-135m", input=texts[1])
    assert one.data[0].embedding == v[1]
    # base64: the same floats, little-endian f32 (the raw body: the client would decode it).
    s, _, body = server.request("POST", "/v1/embeddings", {"input": texts[0], "encoding_format": "base64"})
    raw = base64.b64decode(json.loads(body)["data"][0]["embedding"])
    assert s == 200 and list(struct.unpack(f"<{len(raw) // 4}f", raw)) == v[0]
    # Token ids in; the ids of the same text give the same vector.
    s, _, body = server.request("POST", "/tokenize", {"content": texts[0], "add_special": True})
    ids = json.loads(body)["tokens"]
    s, _, body = server.request("POST", "/v1/embeddings", {"input": [ids]})
    assert s == 200 and json.loads(body)["data"][0]["embedding"] == v[0]
    # llama-server's form.
    s, _, body = server.request("POST", "/embedding", {"content": texts[1]})
    out = json.loads(body)
    assert s == 200 and out[0]["index"] == 0 and out[0]["embedding"] == [v[1]], out


def test_embedding_requests_that_cannot_be_served_are_400s(server):
    for body, param in [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1, 2, 10**9]}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 64}, "dimensions"),
        ({"input": "word " * 5000}, "input"),
    ]:
        s, _, resp = server.request("POST", "/v1/embeddings", body)
        e = json.loads(resp)["error"]
        assert s == 400 and e["param"] == param, (body, s, e)
    # Any model name is served, and the answer names the served model (test_drop_in.py).
    s, _, resp = server.request("POST", "/v1/embeddings", {"input": "x", "model": "other"})
    assert s == 200 and json.loads(resp)["model"] == server.model, resp


def test_an_embeddings_batch_counts_as_one_request_up_to_2048_inputs(server):
    """More inputs than the queue holds (`--max-waiting`; 257 against the default 256 was a
    429 on an idle server): served, as one request, in input order, each vector the one its
    input gets alone. Past 2,048 inputs, a 400."""
    s, _, resp = server.request("POST", "/v1/embeddings", {"input": ["x"] * 2049})
    e = json.loads(resp)["error"]
    assert s == 400 and e["param"] == "input" and "2048" in e["message"], e
    from conftest import Server

    texts = [f"Sentence number {i} about cats." for i in range(40)]
    srv = Server("--ctx-size", "256", "--max-waiting", "4", keys=())
    try:
        c = srv.client()
        r = c.embeddings.create(model=srv.model, input=texts)
        assert [d.index for d in r.data] == list(range(40))
        for i in (0, 5, 39):
            one = c.embeddings.create(model=srv.model, input=texts[i])
            assert one.data[0].embedding == r.data[i].embedding, i
    finally:
        srv.stop()
