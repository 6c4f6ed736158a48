"""llama-server's own endpoints that clients call: `/props`, `/apply-template`, `/v1/health`."""

import json


def test_props_apply_template_and_v1_health(server):
    s, _, body = server.request("GET", "/props")
    p = json.loads(body)
    assert s == 200 and p["total_slots"] == 16 and p["default_generation_settings"]["n_ctx"] == 1024, p
    assert "im_start" in p["chat_template"] and p["model_alias"] == "smollm2-135m", p
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    s, _, body = server.request("POST", "/apply-template", {"messages": msgs})
    prompt = json.loads(body)["prompt"]
    assert s == 200 and "Hi there" in prompt and prompt.endswith("<|im_start|>assistant\n"), prompt
    s, _, body = server.request("POST", "/apply-template", {"messages": msgs, "add_generation_prompt": False})
    assert not json.loads(body)["prompt"].endswith("assistant\n")
    s, _, body = server.request("POST", "/apply-template", {"messages": []})
    assert s == 400 and json.loads(body)["error"]["param"] == "messages"
    s, _, body = server.request("GET", "/v1/health", headers={"Authorization": ""})
    assert s == 200 and json.loads(body)["status"] == "ok"
    # /tokenize as llama-server spells it: pieces with the ids.
    s, _, body = server.request("POST", "/tokenize", {"content": "Hello world, héllo", "with_pieces": True})
    toks = json.loads(body)["tokens"]
    assert s == 200 and all(isinstance(t["id"], int) for t in toks), toks
    assert "".join(t["piece"] if isinstance(t["piece"], str) else bytes(t["piece"]).decode("latin-1") for t in toks).startswith("Hello world")
    s, _, plain = server.request("POST", "/tokenize", {"content": "Hello world, héllo"})
    assert [t["id"] for t in toks] == json.loads(plain)["tokens"]
    # /slots: one per sequence the engine runs at once, none busy when idle.
    server.wait_idle()
    s, _, body = server.request("GET", "/slots")
    slots = json.loads(body)
    assert s == 200 and [x["id"] for x in slots] == list(range(16)), slots
    assert not any(x["is_processing"] for x in slots) and slots[0]["n_ctx"] == 1024


def test_the_port_answers_503_while_the_model_loads():
    """As llama-server: connections are taken before the model has loaded, and every request
    is a 503 `Loading model` until it has (the load is held back 4 s for the test)."""
    import os
    import re
    import signal
    import subprocess
    import urllib.error
    import urllib.request

    from conftest import model_path, quiver_exe

    env = dict(os.environ, RUST_LOG="quiver_server=debug")
    cmd = [str(quiver_exe()), "serve", "-m", str(model_path()), "--host", "127.0.0.1", "--port", "0", "-t", "2",
           "--load-delay-ms", "4000"]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = None
        for line in p.stderr:
            m = re.search(r"(http://[0-9.:]+) answers 503", line)
            if m:
                url = m.group(1)
                break
        assert url, "no loading line"

        def get(path, body=None):
            req = urllib.request.Request(url + path, data=body and json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        s, body = get("/health")
        assert s == 503 and body["error"]["message"] == "Loading model", body
        s, body = get("/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert s == 503 and body["error"]["type"] == "unavailable_error", body
        for line in p.stderr:
            if "listening on" in line:
                break
        s, body = get("/health")
        assert s == 200 and body["status"] == "ok", body
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)


def test_slots_show_the_running_requests(server):
    """While a request runs, a slot shows it: prompt tokens, positions cached, tokens decoded
    (growing), and it is free again once the request ends."""
    import threading
    import time

    done = threading.Event()

    def long_request():
        server.request("POST", "/v1/completions", {
            "model": server.model, "prompt": "Once upon a time", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True,
        })
        done.set()

    threading.Thread(target=long_request, daemon=True).start()
    seen = []
    t0 = time.time()
    while not done.is_set() and time.time() - t0 < 60:
        s, _, body = server.request("GET", "/slots")
        busy = [x for x in json.loads(body) if x["is_processing"]]
        if busy:
            seen.append(busy[0])
        time.sleep(0.02)
    assert seen, "no slot was seen busy"
    first, last = seen[0], seen[-1]
    assert first["n_prompt_tokens"] > 0 and first["id_task"] >= 0, first
    assert last["next_token"]["n_decoded"] >= first["next_token"]["n_decoded"], (first, last)
    assert last["n_past"] >= last["n_prompt_tokens"], last
    assert any(x["next_token"]["n_decoded"] > 0 for x in seen), seen[-1]
    server.wait_idle()
    s, _, body = server.request("GET", "/slots")
    assert not any(x["is_processing"] for x in json.loads(body))
