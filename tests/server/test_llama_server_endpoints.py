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
