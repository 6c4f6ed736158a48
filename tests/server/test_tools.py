"""Tool calls through the official `openai` client. SmolLM2's template shows no tool-call syntax,
so quiver uses the Hermes form (`<tool_call>{...}</tool_call>`); `tool_choice` "required" or a
named function forces a call by grammar, whatever the small model would have said. The calls
come back as OpenAI's `tool_calls` (whole and streamed), arguments valid against the tool's
parameters."""

import json

import openai
import pytest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model="smollm2-135m", messages=kw.pop("messages", MSGS), **kw)


def check_weather(call):
    assert call.type == "function" and call.function.name == "get_weather", call
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and isinstance(args["city"], str) and args["unit"] in ("C", "F"), args


def test_required_forces_a_call(server, client):
    for seed in range(3):
        r = chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, temperature=0.8, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        assert c.message.content is None, c
        assert len(c.message.tool_calls) == 1, c
        call = c.message.tool_calls[0]
        assert call.function.name in ("get_weather", "get_time"), call
        if call.function.name == "get_weather":
            check_weather(call)
        else:
            assert json.loads(call.function.arguments) == {}


def test_named_function_and_streaming(server, client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = chat(client, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    check_weather(c.message.tool_calls[0])
    # Streamed: the same call in OpenAI's deltas.
    name, args, finish = "", "", None
    for ch in chat(client, tools=[WEATHER, TIME], tool_choice=choice, parallel_tool_calls=False, temperature=0, stream=True):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        for tc in d.tool_calls or []:
            assert tc.index == 0
            name += tc.function.name or ""
            args += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert (name, json.loads(args)) == (c.message.tool_calls[0].function.name, json.loads(c.message.tool_calls[0].function.arguments))


def test_none_answers_in_text_and_a_tool_round_trip_renders(server, client):
    r = chat(client, tools=[WEATHER], tool_choice="none", temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    first = chat(client, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, temperature=0)
    call = first.choices[0].message.tool_calls[0]
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})},
    ]
    r = chat(client, messages=msgs, tools=[WEATHER], temperature=0, max_tokens=20)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # The round trip reaches the model: the tool's result is in the rendered prompt.
    s, _, body = server.request("POST", "/apply-template", {"messages": msgs, "tools": [WEATHER]})
    assert s == 200 and '{"temperature": 18}' in json.loads(body)["prompt"], body


@pytest.mark.parametrize(
    "kw",
    [
        dict(tools=[WEATHER], tool_choice="sometimes"),
        dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
        dict(tool_choice="required"),
        dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
    ],
)
def test_bad_tool_choices_are_400s(server, client, kw):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, **kw)
    assert e.value.body["param"] == "tool_choice", e.value.body


@pytest.mark.parametrize(
    "template, marker",
    [
        ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "<｜tool▁call▁begin｜>"),
        ("google-gemma-4-31B-it.jinja", "call:get_weather"),
    ],
)
def test_deepseek_and_gemma4_formats_with_their_templates(template, marker):
    """DeepSeek R1's and Gemma 4's templates (llama.cpp's models/templates): a forced call comes
    out in the template's own syntax (`<｜tool▁calls▁begin｜>…`, `<|tool_call>call:NAME{…}`),
    its arguments held to the tool's schema, and back as `tool_calls`; the call and its result render into the next prompt through the
    template."""
    import os
    from pathlib import Path

    from conftest import Server

    src = os.environ.get("QUIVER_LLAMA_SRC")
    if not src:
        import subprocess

        src = subprocess.run(["bash", "tools/llama-src.sh"], capture_output=True, text=True, check=True).stdout.strip()
    srv = Server("--chat-template-file", str(Path(src) / "models/templates" / template))
    try:
        c = srv.client()
        # (SmolLM2 has neither model's special tokens: the markers are spelled out, hence the room.)
        r = chat(c, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False, temperature=0.7, seed=3, max_tokens=400)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        call = ch.message.tool_calls[0]
        check_weather(call)
        msgs = MSGS + [
            {"role": "assistant", "content": None, "tool_calls": [t.model_dump() for t in ch.message.tool_calls]},
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees"},
        ]
        s, _, body = srv.request("POST", "/apply-template", {"messages": msgs})
        prompt = json.loads(body)["prompt"]
        assert s == 200 and marker in prompt and "22 degrees" in prompt, prompt
    finally:
        srv.stop()


def _pydantic_tool(defs_key):
    """A tool whose parameters reference definitions, as pydantic writes them (`$defs`) or as
    older generators do (`definitions`), one definition referencing another."""
    return {
        "type": "function",
        "function": {
            "name": "book",
            "parameters": {
                "type": "object",
                "properties": {"place": {"$ref": f"#/{defs_key}/Place"}, "unit": {"$ref": f"#/{defs_key}/Unit"}},
                "required": ["place", "unit"],
                "additionalProperties": False,
                defs_key: {
                    "Place": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"$ref": f"#/{defs_key}/Unit"}},
                        "required": ["city", "unit"],
                        "additionalProperties": False,
                    },
                    "Unit": {"enum": ["C", "F"]},
                },
            },
        },
    }


@pytest.mark.parametrize("defs_key", ["$defs", "definitions"])
def test_forced_calls_resolve_defs(server, client, defs_key):
    tool = _pydantic_tool(defs_key)
    for choice in ["required", {"type": "function", "function": {"name": "book"}}]:
        r = chat(client, tools=[tool, TIME], tool_choice=choice, parallel_tool_calls=False, temperature=0, max_tokens=200)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        call = c.message.tool_calls[0]
        if call.function.name == "get_time":
            continue
        args = json.loads(call.function.arguments)
        assert set(args) == {"place", "unit"} and args["unit"] in ("C", "F"), args
        assert set(args["place"]) == {"city", "unit"} and args["place"]["unit"] in ("C", "F"), args


def _many_tools(n):
    return [
        {"type": "function", "function": {"name": f"tool_{i}", "description": "Looks a thing up. " * 8,
                                          "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
        for i in range(n)
    ]


def test_the_context_bound_counts_what_the_template_renders(server, client):
    """1,000 tools (~250 KB of JSON, more than the 1,024-token context could hold as text) on a
    template that drops them: served, not refused before rendering. A template that renders
    them is still refused, before tokenizing, with the rendered figure."""
    tools = _many_tools(1000)
    assert len(json.dumps(tools)) > 1024 * 81  # past the pre-render byte bound of -c 1024
    r = chat(client, tools=tools, max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens < 100, r.usage
    from conftest import Server

    tmpl = "{{ tools | tojson }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    srv = Server("--ctx-size", "1024", "--chat-template", tmpl)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            chat(srv.client(), tools=tools, max_tokens=4)
        assert e.value.body["code"] == "context_length_exceeded", e.value.body
        assert "1024" in e.value.body["message"], e.value.body
    finally:
        srv.stop()


CAT = {
    "type": "function",
    "function": {
        "name": "Cat",
        "strict": True,
        "parameters": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]},
    },
}
EXTRACT = [{"role": "user", "content": "Extract: Tom is a cat who is 3 years old."}]


def im_end(server):
    s, _, body = server.request("POST", "/tokenize", {"content": "<|im_end|>"})
    return json.loads(body)["tokens"][0]


def test_parameters_without_additional_properties_are_closed(server, client):
    """Issue 33's example: a strict tool whose parameters do not say `additionalProperties`
    (as Pydantic, instructor and LangChain write them) gets only its own keys."""
    r = chat(client, messages=EXTRACT, tools=[CAT], tool_choice="required", max_tokens=60, temperature=0)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"name": "Tom", "age": 3}, c


def test_calls_cut_by_max_tokens(server, client):
    """With the end of turn banned, forced parallel calls run into max_tokens: the whole calls
    come back (finish_reason length), the cut one is dropped and never sent as content."""
    kw = dict(messages=EXTRACT, tools=[CAT], tool_choice="required", temperature=0, logit_bias={str(im_end(server)): -100})
    r = chat(client, max_tokens=70, **kw)
    c = r.choices[0]
    assert c.finish_reason == "length", c
    assert len(c.message.tool_calls) == 1 and json.loads(c.message.tool_calls[0].function.arguments) == {"name": "Tom", "age": 3}, c
    assert not c.message.content, c
    r = chat(client, max_tokens=20, **kw)
    c = r.choices[0]
    assert c.finish_reason == "length" and not c.message.tool_calls and not c.message.content, c
    for max_tokens, n in [(70, 1), (20, 0)]:
        calls, text, finish = [], "", None
        for ch in chat(client, max_tokens=max_tokens, stream=True, **kw):
            if ch.choices:
                d = ch.choices[0].delta
                text += d.content or ""
                calls += d.tool_calls or []
                finish = ch.choices[0].finish_reason or finish
        assert (finish, len(calls), text) == ("length", n, ""), (calls, text)


def test_parallel_calls_are_separated_as_the_template_writes_them(server, client):
    """Hermes / Qwen: one `<tool_call>` block per call, a newline between blocks (the raw
    text, read back from the tokens' log-probabilities)."""
    r = chat(client, messages=EXTRACT, tools=[CAT], tool_choice="required", max_tokens=110, temperature=0,
             logit_bias={str(im_end(server)): -100}, logprobs=True)
    c = r.choices[0]
    raw = "".join(t.token for t in c.logprobs.content)
    assert len(c.message.tool_calls) == 2, raw
    assert "\n</tool_call>\n<tool_call>\n{" in raw, raw
    assert raw.startswith('<tool_call>\n{"name": "Cat", "arguments": {"name": '), raw


def test_legacy_functions(server, client):
    """OpenAI's legacy `functions` / `function_call`: the call comes back as `function_call`
    (finish_reason function_call), whole and streamed, and a function result renders."""
    fn = CAT["function"]
    kw = dict(messages=EXTRACT, functions=[fn], function_call={"name": "Cat"}, max_tokens=60, temperature=0)
    r = chat(client, **kw)
    c = r.choices[0]
    assert c.finish_reason == "function_call" and c.message.tool_calls is None, c
    assert c.message.function_call.name == "Cat", c
    assert json.loads(c.message.function_call.arguments) == {"name": "Tom", "age": 3}
    name, args, finish = "", "", None
    for ch in chat(client, stream=True, **kw):
        if ch.choices:
            fc = ch.choices[0].delta.function_call
            name += (fc and fc.name) or ""
            args += (fc and fc.arguments) or ""
            finish = ch.choices[0].finish_reason or finish
    assert (name, json.loads(args), finish) == ("Cat", {"name": "Tom", "age": 3}, "function_call")
    history = EXTRACT + [
        {"role": "assistant", "content": None, "function_call": {"name": "Cat", "arguments": c.message.function_call.arguments}},
        {"role": "function", "name": "Cat", "content": "saved"},
    ]
    r = chat(client, messages=history, functions=[fn], function_call="none", max_tokens=8, temperature=0)
    assert r.choices[0].message.function_call is None and r.choices[0].message.content, r
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, messages=EXTRACT, functions=[fn], tools=[CAT], max_tokens=4)
    assert e.value.body["param"] == "functions", e.value.body


def test_a_last_assistant_message_is_continued(server, client):
    """Prefill, as llama-server does it: the answer continues the last assistant message
    (greedy: the same text as the raw prompt of the template plus that message's text)."""
    prefill = "Sure! Here is a short poem about the sea:\n\n"
    msgs = [{"role": "user", "content": "Write a poem."}, {"role": "assistant", "content": prefill}]
    r = chat(client, messages=msgs, max_tokens=16, temperature=0)
    s, _, body = server.request("POST", "/apply-template", {"messages": msgs[:1]})
    prompt = json.loads(body)["prompt"] + prefill
    # /apply-template renders it as the chat request does.
    s, _, body = server.request("POST", "/apply-template", {"messages": msgs})
    assert s == 200 and json.loads(body)["prompt"] == prompt, body
    raw = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == raw.choices[0].text, (r, raw)
    assert r.usage.prompt_tokens == raw.usage.prompt_tokens


def test_auto_calls_follow_the_closed_schema():
    """`tool_choice: auto` (Qwen 2.5's template, which shows the model the tools and the
    `<tool_call>` form): the answer is free until `<tool_call>`, and the call after it follows
    the tool's closed schema (left free, the small model names the call after the cat and
    writes the schema back as arguments). Free text stays free."""
    import os
    import subprocess
    from pathlib import Path

    from conftest import Server

    src = os.environ.get("QUIVER_LLAMA_SRC") or subprocess.run(
        ["bash", "tools/llama-src.sh"], capture_output=True, text=True, check=True).stdout.strip()
    srv = Server("--chat-template-file", str(Path(src) / "models/templates/Qwen-Qwen2.5-7B-Instruct.jinja"), "-c", "1024")
    try:
        c = srv.client()
        msgs = [{"role": "user", "content": "Call the Cat tool for Tom, 3 years old."}]
        r = chat(c, messages=msgs, tools=[CAT], parallel_tool_calls=False, max_tokens=80, temperature=0)
        ch = r.choices[0]
        assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1, ch
        assert ch.message.tool_calls[0].function.name == "Cat"
        assert json.loads(ch.message.tool_calls[0].function.arguments) == {"name": "Tom", "age": 3}, ch
        r = chat(c, messages=[{"role": "user", "content": "Say hello."}], tools=[CAT], max_tokens=30, temperature=0)
        assert r.choices[0].message.content and not r.choices[0].message.tool_calls, r
    finally:
        srv.stop()
