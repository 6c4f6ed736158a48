"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) through the official
`anthropic` client, against the real SmolLM2 server: text, system, content blocks, tools with
`tool_use` / `tool_result`, `tool_choice`, streaming events, stop sequences, usage, errors in
Anthropic's shape, and the key as `x-api-key`."""

import json

import anthropic
import pydantic
import pytest

USER = [{"role": "user", "content": "Count from 1 to 10 with commas"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
# The SDK has no `temperature` argument any more; the API still takes the field.
T0 = {"temperature": 0}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {}, "additionalProperties": False}}


@pytest.fixture(scope="module")
def ac(server):
    return anthropic.Anthropic(base_url=server.url, api_key=server.key, max_retries=0, timeout=120)


def chat_text(client, model, messages, **kw):
    r = client.chat.completions.create(model=model, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content, r


def test_text_matches_chat_completions(server, client, ac):
    system = "You are a counting assistant."
    m = ac.messages.create(model="claude-sonnet-4-5", max_tokens=24, extra_body=T0, system=system, messages=USER)
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    # Any model name is served; the answer names the served model.
    assert m.model == server.model
    want, ref = chat_text(client, server.model, [{"role": "system", "content": system}, *USER], max_tokens=24)
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == want
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 24
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == ref.usage.prompt_tokens
    # System as blocks, content as blocks: the same prompt.
    m2 = ac.messages.create(model="x", max_tokens=24, extra_body=T0, system=[{"type": "text", "text": system}],
                            messages=[{"role": "user", "content": [{"type": "text", "text": USER[0]["content"]}]}])
    assert m2.content[0].text == want


def test_count_tokens(server, ac):
    system = "Be brief."
    n = ac.messages.count_tokens(model="claude", system=system, messages=USER).input_tokens
    _, _, body = server.request("POST", "/tokenize", {"messages": [{"role": "system", "content": system}, *USER]})
    assert n == json.loads(body)["count"] > 10


def test_stop_sequences_and_end_turn(ac):
    m = ac.messages.create(model="m", max_tokens=60, extra_body=T0, messages=USER, stop_sequences=["5", "zzz"])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "5", m
    assert "5" not in m.content[0].text and "4" in m.content[0].text
    m = ac.messages.create(model="m", max_tokens=200, extra_body=T0,
                           messages=[{"role": "user", "content": "Say hello."}])
    assert m.stop_reason == "end_turn" and m.stop_sequence is None and m.usage.output_tokens < 200, m


def test_streaming_events(server, ac):
    kinds = []
    with ac.messages.stream(model="m", max_tokens=60, extra_body=T0, messages=USER, stop_sequences=["7"]) as s:
        for ev in s:
            kinds.append(ev.type)
        final = s.get_final_message()
    whole = ac.messages.create(model="m", max_tokens=60, extra_body=T0, messages=USER, stop_sequences=["7"])
    assert kinds[0] == "message_start"
    assert "content_block_start" in kinds and "content_block_delta" in kinds and "content_block_stop" in kinds
    assert kinds[-2:] == ["message_delta", "message_stop"]
    assert final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "7")
    assert final.usage.output_tokens == whole.usage.output_tokens
    # On the wire: each event named, a ping after message_start.
    s, h, b = server.request("POST", "/v1/messages", {"model": "m", "max_tokens": 3, "messages": USER, "stream": True})
    assert s == 200 and h["content-type"].startswith("text/event-stream")
    names = [l[len("event: "):] for l in b.decode().splitlines() if l.startswith("event: ")]
    datas = [json.loads(l[len("data: "):]) for l in b.decode().splitlines() if l.startswith("data: ")]
    assert names[:2] == ["message_start", "ping"] and names[-1] == "message_stop"
    assert [d["type"] for d in datas] == names


def test_tools_forced_and_results(ac):
    q = [{"role": "user", "content": "What is the weather in Paris?"}]
    m = ac.messages.create(model="m", max_tokens=120, extra_body=T0, messages=q, tools=[WEATHER, TIME],
                           tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use", m
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) >= 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    assert set(uses[0].input) == {"city", "unit"} and uses[0].input["unit"] in ("C", "F")
    m = ac.messages.create(model="m", max_tokens=120, extra_body=T0, messages=q, tools=[WEATHER, TIME],
                           tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert m.stop_reason == "tool_use" and sum(b.type == "tool_use" for b in m.content) == 1
    # Streamed: the call arrives as a tool_use block with input_json_delta.
    deltas = []
    with ac.messages.stream(model="m", max_tokens=120, extra_body=T0, messages=q, tools=[WEATHER],
                            tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}) as s:
        for ev in s:
            if ev.type == "content_block_delta" and ev.delta.type == "input_json_delta":
                deltas.append(ev.delta.partial_json)
        final = s.get_final_message()
    call = [b for b in final.content if b.type == "tool_use"][0]
    assert final.stop_reason == "tool_use" and call.input == json.loads("".join(deltas)) == uses[0].input
    # The result goes back as a tool_result block; none forces no call.
    follow = q + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "get_weather", "input": uses[0].input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 25 degrees"}]},
    ]
    m = ac.messages.create(model="m", max_tokens=40, extra_body=T0, messages=follow, tools=[WEATHER], tool_choice={"type": "none"})
    assert m.stop_reason in ("end_turn", "max_tokens") and all(b.type == "text" for b in m.content), m
    # The tool result reaches the prompt.
    with_result = ac.messages.count_tokens(model="m", messages=follow, tools=[WEATHER]).input_tokens
    without = ac.messages.count_tokens(model="m", messages=follow[:2], tools=[WEATHER]).input_tokens
    assert with_result > without


def test_errors_are_anthropic_shaped(server, ac):
    with pytest.raises(anthropic.BadRequestError) as ei:
        ac.messages.create(model="m", max_tokens=8, messages=[{"role": "system", "content": "x"}])
    assert ei.value.status_code == 400
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert "messages.0.role" in ei.value.body["error"]["message"]
    for body, needle in [
        ({"model": "m", "messages": USER}, "max_tokens"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "temperature": 7}, "temperature"),
        ({"model": "m", "max_tokens": 8, "messages": USER, "stop_sequences": ["x" * 300]}, "stop_sequences"),
        ({"model": "m", "max_tokens": 5000, "messages": USER}, "context"),
        ({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
    ]:
        s, _, b = server.request("POST", "/v1/messages", body)
        e = json.loads(b)
        assert s == 400 and e["type"] == "error" and e["error"]["type"] == "invalid_request_error", (body, e)
        assert needle in e["error"]["message"], (needle, e)
    s, _, b = server.request("POST", "/v1/messages", raw=b"{not json")
    assert s == 400 and json.loads(b)["error"]["type"] == "invalid_request_error"
    # Keys: `x-api-key` as Anthropic's clients send it, or Bearer; a wrong one is a 401 in its shape.
    ok = {"model": "m", "max_tokens": 2, "messages": USER}
    s, _, _ = server.request("POST", "/v1/messages", ok, headers={"Authorization": "", "x-api-key": server.key})
    assert s == 200
    s, _, b = server.request("POST", "/v1/messages", ok, headers={"Authorization": "", "x-api-key": "wrong"})
    assert s == 401 and json.loads(b)["error"]["type"] == "authentication_error"
    bad = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model="m", max_tokens=2, messages=USER)
    # Without `/v1`, as llama-server serves it.
    s, _, b = server.request("POST", "/messages", ok)
    assert s == 200 and json.loads(b)["type"] == "message"
    s, _, b = server.request("POST", "/messages/count_tokens", {"messages": USER})
    assert s == 200 and json.loads(b)["input_tokens"] > 0


def test_output_config_format(ac):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    m = ac.messages.create(model="m", max_tokens=60, extra_body=T0, output_config={"format": {"type": "json_schema", "schema": schema}},
                           messages=[{"role": "user", "content": "Tom is a cat who is 3 years old. Answer in JSON."}])
    v = json.loads(m.content[0].text)
    assert set(v) == {"name", "age"} and isinstance(v["age"], int), v


class Cat(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


def test_parse_with_a_pydantic_model(ac):
    m = ac.messages.parse(model="m", max_tokens=60, extra_body=T0, output_format=Cat,
                          messages=[{"role": "user", "content": "Tom is a cat who is 3 years old. Answer in JSON."}])
    assert isinstance(m.parsed_output, Cat), m
