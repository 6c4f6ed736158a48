"""llama-server's `/completion` (its field names and response shape, whole and streamed) gives
what `/v1/completions` gives for the same request; `/infill` needs a model with FIM tokens
(SmolLM2 has none: a 400 naming the field; the prompt layout is a unit test in native.rs)."""

import json
import urllib.request


def test_completion_matches_v1_completions(server, client):
    prompt = "The three primary colors are"
    ref = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=12, temperature=0)
    s, _, body = server.request("POST", "/completion", {"prompt": prompt, "n_predict": 12, "temperature": 0, "cache_prompt": True, "seed": -1})
    r = json.loads(body)
    assert s == 200 and r["content"] == ref.choices[0].text, (r, ref)
    assert r["stop"] is True and r["tokens_predicted"] == 12 and r["stop_type"] == "limit"
    assert r["tokens_evaluated"] == ref.usage.prompt_tokens and r["prompt"] == prompt
    t = r["timings"]
    assert t["predicted_n"] == 12 and t["predicted_ms"] > 0 and t["prompt_n"] <= r["tokens_evaluated"]
    # Streamed: `data:` lines of pieces, then the totals with stop: true; no [DONE].
    req = urllib.request.Request(
        server.url + "/completion",
        data=json.dumps({"prompt": prompt, "n_predict": 12, "temperature": 0, "stream": True}).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.key}"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = [l.decode().strip() for l in resp if l.strip()]
    assert all(l.startswith("data: ") for l in lines) and "[DONE]" not in lines[-1]
    events = [json.loads(l[6:]) for l in lines]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert "".join(e["content"] for e in events) == ref.choices[0].text
    assert events[-1]["tokens_predicted"] == 12
    # An end-of-generation stop is "eos"; a stop string "word".
    s, _, body = server.request("POST", "/completion", {"prompt": prompt, "n_predict": 40, "temperature": 0, "stop": [" "]})
    r = json.loads(body)
    assert s == 200 and r["stop_type"] == "word" and " " not in r["content"].strip(), r


def test_completion_and_infill_errors(server):
    for path, body, param in [
        ("/completion", {"prompt": "hi", "n_predict": 0}, "n_predict"),
        ("/completion", {"n_predict": 4}, "prompt"),
        ("/completion", {"prompt": "hi", "n_probs": 21}, "n_probs"),
        ("/infill", {"input_prefix": "def f():", "input_suffix": "\n"}, "input_prefix"),
    ]:
        s, _, resp = server.request("POST", path, body)
        e = json.loads(resp)["error"]
        assert s == 400 and e["param"] == param, (path, body, s, e)
