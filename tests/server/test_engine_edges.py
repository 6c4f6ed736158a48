"""Edges the attack review found between the HTTP side and the engine: echo with logprobs,
requests ended by a disconnect in the finish counters, and a prompt that leaves little room."""

import json
import math

PROMPT = "The capital of France is"


def completion(server, **body):
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": PROMPT, "temperature": 0, **body})
    assert status == 200, raw
    return json.loads(raw)


def test_echo_with_logprobs_scores_the_prompt(server):
    r = completion(server, max_tokens=3, echo=True, logprobs=2)
    c = r["choices"][0]
    lp = c["logprobs"]
    n_prompt = r["usage"]["prompt_tokens"]
    assert c["text"].startswith(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == n_prompt + 3
    # The first prompt token has no logprob; every other is a real log-probability, at most
    # the best of its top list.
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n_prompt + 3):
        v = lp["token_logprobs"][i]
        assert v is not None and v <= 0 and math.isfinite(v), (i, v)
        assert max(lp["top_logprobs"][i].values()) >= v - 1e-6
    # Offsets start at 0, never go back, and the generated tokens' follow the echoed text.
    offs = lp["text_offset"]
    assert offs[0] == 0 and offs == sorted(offs)
    assert offs[n_prompt] == len(PROMPT)
    # The generated tokens score as without echo (the prompt is computed the same way).
    plain = completion(server, max_tokens=3, logprobs=2)["choices"][0]["logprobs"]
    assert lp["tokens"][n_prompt:] == plain["tokens"]
    for a, b in zip(lp["token_logprobs"][n_prompt:], plain["token_logprobs"]):
        assert abs(a - b) < 1e-4
    # Streamed: the echoed prompt comes first, with its logprobs.
    status, _, raw = server.request(
        "POST", "/v1/completions",
        {"prompt": PROMPT, "temperature": 0, "max_tokens": 3, "echo": True, "logprobs": 2, "stream": True},
    )
    chunks = [json.loads(l[6:]) for l in raw.decode().splitlines() if l.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"] == PROMPT
    assert first["logprobs"]["token_logprobs"] == lp["token_logprobs"][:n_prompt]


def test_a_disconnect_counts_as_an_abort(server, client):
    server.wait_idle()
    before = server.metrics().get('quiver_request_finished_total{finish_reason="abort"}', 0)
    stream = client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=500, stream=True, temperature=0, extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    server.wait_idle(timeout=15)
    after = server.metrics().get('quiver_request_finished_total{finish_reason="abort"}', 0)
    assert after == before + 1


def test_a_prompt_near_the_context_ends_by_length_not_silently(server):
    # The session server has a 1024-token context: leave it 6 tokens of room. The default
    # max_tokens (16 for completions, the rest of the context for chat) is cut to the room
    # left, and the answer says `length`.
    words = "one two three four five six seven eight nine ten " * 200
    ids = json.loads(server.request("POST", "/tokenize", {"prompt": words})[2])["tokens"][:1018]
    r = json.loads(server.request(
        "POST", "/v1/completions", {"prompt": ids, "temperature": 0, "ignore_eos": True})[2])
    c = r["choices"][0]
    assert r["usage"]["prompt_tokens"] == 1018
    assert r["usage"]["completion_tokens"] == 6 and c["finish_reason"] == "length"
    # Asking for more than fits is a 400 naming both lengths.
    status, _, raw = server.request("POST", "/v1/completions", {"prompt": ids, "max_tokens": 50})
    assert status == 400 and "1018" in json.loads(raw)["error"]["message"]
