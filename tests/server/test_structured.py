"""Constrained decoding through the official `openai` client: JSON schemas (parsed into a Pydantic
model by `client.beta.chat.completions.parse`), `json_object`, a Lark grammar, vLLM's
`guided_choice` / `guided_regex`, streaming, and the 400s for what cannot be followed. The test
model (SmolLM2-135M) would not write JSON by itself: every answer below is the grammar's doing."""

import json
import re

import openai
import pytest
from pydantic import BaseModel


class Person(BaseModel):
    name: str
    age: int
    likes_cats: bool


PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "likes_cats": {"type": "boolean"},
    },
    "required": ["name", "age", "likes_cats"],
    "additionalProperties": False,
}


def ask(client, **kw):
    return client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Describe a person."}],
        max_tokens=120,
        **kw,
    )


def test_json_schema_parses_into_a_pydantic_model(server, client):
    for seed in range(4):
        r = client.beta.chat.completions.parse(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Invent a person."}],
            response_format=Person,
            max_tokens=120,
            temperature=0.9,
            seed=seed,
        )
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        p = c.message.parsed
        assert isinstance(p, Person) and isinstance(p.age, int), c.message.content


def test_json_schema_bounds_are_followed(server, client):
    for seed in range(4):
        r = ask(
            client,
            response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
            temperature=1.0,
            seed=seed,
        )
        v = json.loads(r.choices[0].message.content)
        assert set(v) == {"name", "age", "likes_cats"}, v
        assert isinstance(v["name"], str) and len(v["name"]) <= 24, v
        assert isinstance(v["age"], int) and 0 <= v["age"] <= 150, v
        assert isinstance(v["likes_cats"], bool), v


def test_json_object_and_streaming(server, client):
    # Any object; a prompt the small model answers with a short one (left free, it can also
    # write a number without end: `json_object` bounds nothing).
    msgs = [{"role": "user", "content": "Give a JSON object with a city and its country."}]
    kw = dict(model="smollm2-135m", messages=msgs, max_tokens=120, response_format={"type": "json_object"}, temperature=0)
    r = client.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    assert isinstance(json.loads(c.message.content), dict)
    chunks = list(client.chat.completions.create(**kw, stream=True))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content


def test_grammar_choice_and_regex(server, client):
    lark = 'start: "The answer is " ANSWER "."\nANSWER: /(yes|no|maybe)/'
    r = ask(client, extra_body={"grammar": lark}, temperature=1.0, seed=3)
    assert re.fullmatch(r"The answer is (yes|no|maybe)\.", r.choices[0].message.content), r
    r = ask(client, extra_body={"guided_choice": ["red", "green", "blue"]}, temperature=1.0, seed=5)
    assert r.choices[0].message.content in ("red", "green", "blue"), r
    r = client.completions.create(
        model="smollm2-135m", prompt="Call me at", max_tokens=40, extra_body={"guided_regex": r" \d{3}-\d{4}"}
    )
    assert re.fullmatch(r" \d{3}-\d{4}", r.choices[0].text), r
    # llama-server's grammars are GBNF.
    gbnf = 'root ::= "[" num ("," num){2} "]"\nnum ::= [0-9]{1,3}\n'
    r = client.completions.create(model="smollm2-135m", prompt="Three numbers:", max_tokens=20, extra_body={"grammar": gbnf})
    assert re.fullmatch(r"\[[0-9]{1,3}(,[0-9]{1,3}){2}\]", r.choices[0].text), r


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "bogus"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}, "response_format"),
        ({"grammar": 'root ::= "a'}, "grammar"),
        ({"grammar": 'start ::= "a"'}, "grammar"),
        ({"grammar": "start: undefined_rule"}, "grammar"),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
    ],
)
def test_what_cannot_be_followed_is_a_400(server, client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body=body
        )
    assert e.value.status_code == 400
    assert e.value.body["param"] == param, e.value.body


def token_id(server, text):
    s, _, body = server.request("POST", "/tokenize", {"content": text})
    ids = json.loads(body)["tokens"]
    assert s == 200 and len(ids) == 1, (text, ids)
    return ids[0]


CAT = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}, "required": ["name", "age"]}
EXTRACT = [{"role": "user", "content": "Extract: Tom is a cat who is 3 years old."}]


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "Cat", "schema": CAT, "strict": True}}},
        {"guided_json": CAT},
        {"json_schema": CAT},
        {"structured_outputs": {"json": CAT}},
    ],
)
def test_schemas_without_additional_properties_are_closed(server, client, body):
    """A schema that does not say `additionalProperties` gets only its own keys (the model,
    left free, invents more until max_tokens)."""
    r = client.chat.completions.create(model="smollm2-135m", messages=EXTRACT, max_tokens=60, temperature=0, extra_body=body)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    v = json.loads(c.message.content)
    assert set(v) == {"name", "age"} and isinstance(v["age"], int), v


def test_numbers_are_bounded_in_digits(server, client):
    """Biased towards the digits 1 and 0, the model would write one number to max_tokens:
    each run of digits (integer part, fraction, exponent) stops at 16."""
    bias = {str(token_id(server, d)): 30 for d in "10"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a", "b"]}
    r = client.chat.completions.create(
        model="smollm2-135m", messages=EXTRACT, max_tokens=150, temperature=0, logit_bias=bias,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": schema}},
    )
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    runs = re.findall(r"[0-9]+", c.message.content)
    assert runs and max(len(x) for x in runs) == 16, c.message.content
    v = json.loads(c.message.content)
    assert set(v) == {"a", "b"} and isinstance(v["a"], int), v


def test_vllm_structured_outputs(server, client):
    r = ask(client, extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}}, temperature=1.0, seed=5)
    assert r.choices[0].message.content in ("red", "green", "blue"), r
    r = ask(client, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} is [0-9]{1,2}\."}}, temperature=0)
    assert re.fullmatch(r"[A-Z][a-z]{2,8} is [0-9]{1,2}\.", r.choices[0].message.content), r
    msgs = [{"role": "user", "content": "Give a JSON object with a city and its country."}]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=msgs, max_tokens=120, temperature=0, extra_body={"structured_outputs": {"json_object": True}}
    )
    assert isinstance(json.loads(r.choices[0].message.content), dict), r
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, extra_body={"structured_outputs": {"structural_tag": "{}"}})
    assert e.value.body["param"] == "structured_outputs", e.value.body
