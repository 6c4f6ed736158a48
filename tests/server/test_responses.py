"""OpenAI's Responses API (`/v1/responses`, stateless) through the official `openai` client's
`responses.create`, `.stream` and `.parse`, against the real SmolLM2 server: input as text or
items, instructions, function tools and their outputs, `tool_choice`, `text.format`
json_schema, `max_output_tokens`, usage, streaming events with sequence numbers."""

import json

import openai
import pydantic
import pytest

Q = "Count from 1 to 10 with commas"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


def test_text_matches_chat_completions(server, client):
    r = client.responses.create(model="gpt-4o-mini", input=Q, instructions="Be exact.", max_output_tokens=20, temperature=0)
    ref = client.chat.completions.create(model="x", messages=[{"role": "system", "content": "Be exact."}, {"role": "user", "content": Q}],
                                         max_tokens=20, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == server.model
    assert r.output_text == ref.choices[0].message.content
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.input_tokens == ref.usage.prompt_tokens and r.usage.output_tokens == 20
    assert r.usage.total_tokens == r.usage.input_tokens + 20
    # Input as items with input_text parts: the same prompt.
    items = [{"role": "developer", "content": "Be exact."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": Q}]}]
    r2 = client.responses.create(model="m", input=items, max_output_tokens=20, temperature=0)
    assert r2.output_text == r.output_text
    # An answer that ends by itself is completed.
    r3 = client.responses.create(model="m", input="Say hello.", max_output_tokens=200, temperature=0)
    assert r3.status == "completed" and r3.incomplete_details is None and r3.usage.output_tokens < 200


def test_streaming_events(server, client):
    events = []
    with client.responses.stream(model="m", input=Q, max_output_tokens=20, temperature=0) as s:
        for ev in s:
            events.append(ev)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    for k in ["response.output_item.added", "response.content_part.added", "response.output_text.delta",
              "response.output_text.done", "response.content_part.done", "response.output_item.done"]:
        assert k in kinds, (k, kinds)
    # Cut by max_output_tokens: the stream ends as the whole response does, `incomplete`.
    assert kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    whole = client.responses.create(model="m", input=Q, max_output_tokens=20, temperature=0)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-1].response.output[0].content[0].text
    # One that ends by itself: response.completed, and the SDK's final response.
    with client.responses.stream(model="m", input="Say hello.", max_output_tokens=200, temperature=0) as s:
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text
    # On the wire: each event named as its type.
    st, h, b = server.request("POST", "/v1/responses", {"input": Q, "max_output_tokens": 3, "stream": True})
    names = [l[len("event: "):] for l in b.decode().splitlines() if l.startswith("event: ")]
    datas = [json.loads(l[len("data: "):]) for l in b.decode().splitlines() if l.startswith("data: ")]
    assert st == 200 and names == [d["type"] for d in datas] and names[0] == "response.created"


def test_function_calls_and_outputs(client):
    q = "What is the weather in Paris?"
    r = client.responses.create(model="m", input=q, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
                                max_output_tokens=120, temperature=0)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1, r
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    args = json.loads(call.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("C", "F")
    # Named, streamed: the arguments arrive as function_call_arguments events.
    with client.responses.stream(model="m", input=q, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                                 parallel_tool_calls=False, max_output_tokens=120, temperature=0) as s:
        events = list(s)
        final = s.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"][0]
    fc = [o for o in final.output if o.type == "function_call"][0]
    assert json.loads(done.arguments) == json.loads(fc.arguments) == args
    # The output goes back as a function_call_output item; `none` calls nothing.
    follow = [{"role": "user", "content": q},
              {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 25 degrees"}]
    r = client.responses.create(model="m", input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=30, temperature=0)
    assert all(o.type == "message" for o in r.output) and r.output_text
    more = client.responses.create(model="m", input=follow, tools=[WEATHER], tool_choice="none", max_output_tokens=1)
    less = client.responses.create(model="m", input=follow[:1], tools=[WEATHER], tool_choice="none", max_output_tokens=1)
    assert more.usage.input_tokens > less.usage.input_tokens + 10


class Cat(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    age: int


def test_text_format_json_schema_and_parse(client):
    r = client.responses.parse(model="m", input="Tom is a cat who is 3 years old. Answer in JSON.", text_format=Cat,
                               max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, Cat), r
    with client.responses.stream(model="m", input="Tom is a cat who is 3 years old. Answer in JSON.", text_format=Cat,
                                 max_output_tokens=60, temperature=0) as s:
        final = s.get_final_response()
    assert final.output_parsed == r.output_parsed
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = client.responses.create(model="m", input="Is water wet?", max_output_tokens=30, temperature=0,
                                text={"format": {"type": "json_schema", "name": "yesno", "schema": schema, "strict": True}})
    assert set(json.loads(r.output_text)) == {"ok"}


def test_errors(server, client):
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model="m", input="hi", previous_response_id="resp_123")
    assert ei.value.body["param"] == "previous_response_id" and "stores no responses" in ei.value.body["message"]
    for body, param in [
        ({}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": 5}, "temperature"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "hi", "top_logprobs": 2}, "top_logprobs"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}}, "text.format"),
        ({"input": "hi " * 2000}, "input"),
    ]:
        s, _, b = server.request("POST", "/v1/responses", body)
        e = json.loads(b)["error"]
        assert s == 400 and e["param"] == param, (body, s, e)
    # Without `/v1`, as llama-server serves it.
    s, _, b = server.request("POST", "/responses", {"input": "hi", "max_output_tokens": 2})
    assert s == 200 and json.loads(b)["object"] == "response"
