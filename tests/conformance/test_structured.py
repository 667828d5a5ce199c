"""Structured outputs and tool calling with the official `openai` client against `baton serve`
on the default model (SmolLM2-135M-Instruct), whose output the grammar constrains: every
answer must validate, however small the model.

Reads BATON_SMOL_URL / BATON_SMOL_MODEL; run through tests/conformance/run.sh.
"""

import json
import os
import random

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

BASE_URL = os.environ.get("BATON_SMOL_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("BATON_SMOL_MODEL", "smollm2")
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def client():
    return openai.OpenAI(base_url=BASE_URL, api_key="none", max_retries=0, timeout=600)


def ask(client, content, **kw):
    args = dict(model=MODEL, messages=[{"role": "user", "content": content}], max_tokens=MAX_TOKENS, temperature=0)
    args.update(kw)
    return client.chat.completions.create(**args)


class Pet(BaseModel):
    kind: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    pets: list[Pet] = Field(max_length=2)


def test_parse_returns_a_pydantic_object(client):
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person with a pet as JSON."}],
        response_format=Person,
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].finish_reason == "stop"
    person = r.choices[0].message.parsed
    assert isinstance(person, Person)
    assert 0 <= person.age <= 120


def random_schema(rng, depth=0):
    """A bounded JSON Schema: any output that follows it ends well within MAX_TOKENS."""
    kinds = ["string", "integer", "boolean", "enum"] + (["object", "array"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 12)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["red", "green", "blue", "cyan", "black", "white"], rng.randint(1, 4))}
    if kind == "array":
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": rng.randint(0, 1), "maxItems": rng.randint(1, 3)}
    names = rng.sample(["id", "name", "color", "size", "tags", "owner", "count", "ok"], rng.randint(1, 3))
    properties = {name: random_schema(rng, depth + 1) for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


def test_twenty_random_schemas_validate(client):
    rng = random.Random(20261124)
    schemas = []
    while len(schemas) < 20:
        schema = random_schema(rng)
        if schema["type"] == "object":
            schemas.append(schema)
    # Nested objects, arrays, enums and required fields all occur.
    text = json.dumps(schemas)
    assert '"type": "array"' in text and '"enum"' in text and text.count('"type": "object"') > 20
    for i, schema in enumerate(schemas):
        r = ask(
            client,
            "Answer with a JSON object.",
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (schema, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "hour24": {"type": "boolean"}},
            "required": ["city", "hour24"],
            "additionalProperties": False,
        },
    },
}
TOOLS = {t["function"]["name"]: t for t in (WEATHER, TIME)}


def check_calls(calls):
    assert calls
    for call in calls:
        assert call["id"].startswith("call_")
        schema = TOOLS[call["name"]]["function"]["parameters"]
        jsonschema.validate(json.loads(call["arguments"]), schema)


def calls_of(message):
    return [{"id": c.id, "name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]


def streamed_calls(stream):
    """Reassembles tool calls from deltas the way the OpenAI SDK's consumers do."""
    calls, finish = {}, None
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for d in choice.delta.tool_calls or []:
            if d.index not in calls:
                assert d.id and d.type == "function" and d.function.name, d
                calls[d.index] = {"id": d.id, "name": d.function.name, "arguments": ""}
            else:
                assert d.id is None and d.function.name is None, d
            calls[d.index]["arguments"] += d.function.arguments or ""
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("stream", [False, True])
def test_required_tool_choice_gives_valid_calls(client, stream):
    kw = dict(tools=[WEATHER, TIME], tool_choice="required")
    if stream:
        calls, finish = streamed_calls(ask(client, "What is the weather in Paris?", stream=True, **kw))
    else:
        r = ask(client, "What is the weather in Paris?", **kw)
        calls, finish = calls_of(r.choices[0].message), r.choices[0].finish_reason
        assert r.choices[0].message.content is None
    assert finish == "tool_calls"
    check_calls(calls)


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function(client, stream):
    kw = dict(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    if stream:
        calls, finish = streamed_calls(ask(client, "What time is it?", stream=True, **kw))
    else:
        r = ask(client, "What time is it?", **kw)
        calls, finish = calls_of(r.choices[0].message), r.choices[0].finish_reason
    assert finish == "tool_calls"
    assert [c["name"] for c in calls] == ["get_time"]
    check_calls(calls)


def test_parallel_tool_calls(client):
    prompt = "Weather in Paris and in Tokyo, and the time in Lima?"
    one = ask(client, prompt, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert len(one.choices[0].message.tool_calls) == 1
    check_calls(calls_of(one.choices[0].message))
    many = ask(client, prompt, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=True)
    assert len(many.choices[0].message.tool_calls) >= 1
    check_calls(calls_of(many.choices[0].message))


def test_streamed_structured_output_reassembles(client):
    schema = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "enum": ["red", "blue"]}, "maxItems": 3}}, "required": ["colors"], "additionalProperties": False}
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    whole = ask(client, "Some colors?", **kw).choices[0].message.content
    chunks = list(ask(client, "Some colors?", stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    jsonschema.validate(json.loads(text), schema)


def test_completions_take_vllm_constraints(client):
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=10, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(model=MODEL, prompt="A number:", max_tokens=10, temperature=0, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(r.choices[0].text) == 3 and r.choices[0].text.isdigit()
