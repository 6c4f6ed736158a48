"""Real clients from PyPI against `quiver serve`: the `openai` client's structured-output parse
with a Pydantic model, `langchain-openai` (`with_structured_output`, `bind_tools` with a tool
message round trip) and `litellm` (a chat and a stream). With the small test model a schema is
still followed exactly: the output parses and validates on every request."""

import os

import pytest
from pydantic import BaseModel, Field

from conftest import KEY

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch at import
os.environ.setdefault("LITELLM_TELEMETRY", "False")


class City(BaseModel):
    name: str = Field(max_length=40)
    population: int = Field(ge=0, le=100_000_000)
    coastal: bool


MSGS = [{"role": "user", "content": "Describe Lisbon as JSON."}]


def test_openai_parse_with_a_pydantic_model(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in range(3):
        r = parse(model="smollm2-135m", messages=MSGS, response_format=City, max_tokens=200, temperature=0.8, seed=seed)
        city = r.choices[0].message.parsed
        assert isinstance(city, City), r
        assert 0 <= city.population <= 100_000_000 and len(city.name) <= 40


def test_langchain_structured_output_and_tools(server):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model="smollm2-135m", max_tokens=80, temperature=0)
    city = llm.with_structured_output(City).invoke("Describe Lisbon.")
    assert isinstance(city, City), city

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny in {city}"

    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    q = HumanMessage("What is the weather in Porto?")
    ai = bound.invoke([q])
    assert len(ai.tool_calls) == 1 and ai.tool_calls[0]["name"] == "get_weather", ai
    call = ai.tool_calls[0]
    assert isinstance(call["args"].get("city"), str), call
    result = get_weather.invoke(call["args"])
    final = llm.bind_tools([get_weather]).invoke([q, ai, ToolMessage(result, tool_call_id=call["id"])])
    assert isinstance(final.content, str) and final.content, final


def test_litellm_chat_and_stream(server):
    litellm = pytest.importorskip("litellm")
    kw = dict(model="openai/smollm2-135m", api_base=server.url + "/v1", api_key=KEY, messages=[{"role": "user", "content": "Say hi."}], max_tokens=12, temperature=0)
    r = litellm.completion(**kw)
    text = r.choices[0].message.content
    assert isinstance(text, str) and text
    parts = [c.choices[0].delta.content or "" for c in litellm.completion(stream=True, **kw)]
    assert "".join(parts) == text
