"""Agent frameworks and structured-output clients from PyPI against `quiver serve` and the real
model (smollm2-135m, greedy): pydantic-ai (an Agent that calls a tool, then returns a Pydantic
model through its output tool; and through `response_format`), instructor (TOOLS, TOOLS_STRICT,
JSON_SCHEMA and JSON modes), langchain-openai's `with_structured_output` by each of its three
methods and `bind_tools` with a forced tool, and the `openai` client's `.parse` with a strict
Pydantic tool. Each asserts the validated object, and where the model's greedy answer is known,
its values.

Modes that only *tell* the model the schema (instructor's JSON, LangChain's `json_mode`: a
`json_object` response format, any object) get a prompt that names the keys: the 135M model
does not follow a schema it is shown in a system prompt."""

import pytest
from pydantic import BaseModel

from conftest import KEY


class Cat(BaseModel):
    name: str
    age: int


TOM = "Extract: Tom is a cat who is 3 years old."
TOM_KEYS = 'Tom is a cat who is 3 years old. Answer in JSON with the keys "name" and "age".'


def pai_model(server):
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    return OpenAIChatModel(server.model, provider=OpenAIProvider(base_url=server.url + "/v1", api_key=KEY))


def test_pydantic_ai_agent_calls_a_tool_then_returns_structured_output(server):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    class City(BaseModel):
        name: str
        population: int

    calls = []
    agent = Agent(pai_model(server), output_type=City, model_settings={"temperature": 0, "max_tokens": 120})

    @agent.tool_plain
    def population_of(city: str) -> int:
        """The population of a city."""
        calls.append(city)
        return 545_000

    r = agent.run_sync("What is the population of Lisbon? Use the tool, then answer.")
    assert isinstance(r.output, City)
    assert calls and calls[0] == "Lisbon", calls
    # The tool's answer went back to the model and came out in the validated output.
    assert r.output.population == 545_000, r.output
    called = [p.tool_name for m in r.all_messages() if isinstance(m, ModelResponse)
              for p in m.parts if isinstance(p, ToolCallPart)]
    assert called[0] == "population_of" and called[-1] == "final_result", called


def test_pydantic_ai_native_output_uses_the_response_format(server):
    from pydantic_ai import Agent, NativeOutput

    agent = Agent(pai_model(server), output_type=NativeOutput(Cat), model_settings={"temperature": 0, "max_tokens": 80})
    r = agent.run_sync(TOM)
    assert r.output.model_dump() == {"name": "Tom", "age": 3}


@pytest.mark.parametrize("mode,prompt", [
    ("TOOLS", TOM), ("TOOLS_STRICT", TOM), ("JSON_SCHEMA", TOM), ("JSON", TOM_KEYS),
])
def test_instructor_modes(client, server, mode, prompt):
    import instructor

    ic = instructor.from_openai(client, mode=getattr(instructor.Mode, mode))
    cat, raw = ic.chat.completions.create_with_completion(
        model=server.model, response_model=Cat, max_retries=0, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": prompt}],
    )
    assert cat.model_dump() == {"name": "Tom", "age": 3}
    if mode.startswith("TOOLS"):
        assert raw.choices[0].finish_reason == "tool_calls"
        assert [c.function.name for c in raw.choices[0].message.tool_calls] == ["Cat"]
    else:
        assert raw.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("method,prompt", [
    ("function_calling", TOM), ("json_schema", TOM), ("json_mode", TOM_KEYS),
])
def test_langchain_with_structured_output_by_each_method(server, method, prompt):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=server.model, max_tokens=80, temperature=0, max_retries=0)
    out = llm.with_structured_output(Cat, method=method, include_raw=True).invoke(prompt)
    assert out["parsing_error"] is None, out
    assert out["parsed"].model_dump() == {"name": "Tom", "age": 3}
    raw = out["raw"]
    if method == "function_calling":
        assert [c["name"] for c in raw.tool_calls] == ["Cat"]
    else:
        assert raw.content.strip().startswith("{")


def test_langchain_bind_tools_forced_tool_has_schema_args(server):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=KEY, model=server.model, max_tokens=80, temperature=0, max_retries=0)
    ai = llm.bind_tools([Cat], tool_choice="Cat", strict=True).invoke(TOM)
    assert len(ai.tool_calls) == 1, ai
    assert ai.tool_calls[0]["args"] == {"name": "Tom", "age": 3}


def test_openai_parse_with_a_strict_pydantic_tool(client, server):
    import openai

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=server.model, messages=[{"role": "user", "content": TOM}], temperature=0, max_tokens=80,
        tools=[openai.pydantic_function_tool(Cat)], tool_choice={"type": "function", "function": {"name": "Cat"}},
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "Cat"
    assert calls[0].function.parsed_arguments.model_dump() == {"name": "Tom", "age": 3}
