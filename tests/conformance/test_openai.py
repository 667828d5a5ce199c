"""Conformance of `baton serve` with the official `openai` Python client.

Reads the server from BATON_URL (e.g. http://127.0.0.1:8000) and the served model name
from BATON_MODEL; run through tests/conformance/run.sh, which starts the server.
"""

import os

import openai
import pytest

BASE_URL = os.environ.get("BATON_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("BATON_MODEL", "tiny")


@pytest.fixture(scope="module")
def client():
    # No retries: a 429 or 5xx must surface as the exception under test, not be retried.
    return openai.OpenAI(base_url=BASE_URL, api_key=os.environ.get("BATON_API_KEY", "none"), max_retries=0)


def chat(client, **kw):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0)
    args.update(kw)
    return client.chat.completions.create(**args)


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list()]
    assert ids == [MODEL]


def test_chat_non_streaming(client):
    r = chat(client)
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    assert r.model == MODEL
    assert len(r.choices) == 1
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    full = chat(client, extra_body={"ignore_eos": True})
    stream = chat(client, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"]
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.completion_tokens == 8
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_n_and_logprobs(client):
    r = chat(client, n=2, temperature=1.0, seed=7, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        content = c.logprobs.content
        assert len(content) == 8
        for t in content:
            assert t.logprob <= 0.0
            assert bytes(t.bytes) == t.token.encode("utf-8")
            assert len(t.top_logprobs) == 3
    assert r.usage.completion_tokens == 16


def test_seed_is_reproducible(client):
    a = chat(client, temperature=1.0, seed=1234, max_tokens=12, extra_body={"ignore_eos": True})
    b = chat(client, temperature=1.0, seed=1234, max_tokens=12, extra_body={"ignore_eos": True})
    assert a.choices[0].message.content == b.choices[0].message.content


def test_completions_non_streaming_and_streaming(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 6
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_completions_batch_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=["a b", "c d"], n=2, max_tokens=3, temperature=0)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    r = client.completions.create(model=MODEL, prompt="Echo me", echo=True, max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith("Echo me")
    r = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2, temperature=0, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4
    assert "".join(lp.tokens) == r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt(client):
    # lm-evaluation-harness's loglikelihood request: the prompt's tokens come first in the
    # legacy logprobs (the first with None), then the generated one.
    r = client.completions.create(model=MODEL, prompt="Echo me please", echo=True, logprobs=1, max_tokens=1, temperature=0)
    choice = r.choices[0]
    assert choice.text.startswith("Echo me please")
    lp = choice.logprobs
    n = r.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    # vLLM's prompt_logprobs, through extra_body.
    r = client.completions.create(model=MODEL, prompt="Echo me please", max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2})
    entries = r.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == n and entries[0] is None
    for i, entry in enumerate(entries[1:], start=1):
        # The prompt token itself is in the map, with the logprob the legacy view gives it.
        assert any(abs(v["logprob"] - lp.token_logprobs[i]) < 1e-5 for v in entry.values()), (i, entry)
        assert all({"logprob", "rank", "decoded_token"} <= set(v) for v in entry.values())


def test_stop_string_truncates(client):
    full = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    r = client.completions.create(model=MODEL, prompt="Once", max_tokens=30, temperature=0, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_bad_requests_raise_the_right_error_classes(client):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, temperature=-1)
    assert e.value.param == "temperature"
    assert "temperature" in e.value.message
    with pytest.raises(openai.BadRequestError):
        chat(client, messages=[])
    with pytest.raises(openai.BadRequestError):
        chat(client, max_tokens=10**7)
    with pytest.raises(openai.BadRequestError):
        chat(client, n=0)
    with pytest.raises(openai.NotFoundError) as e:
        chat(client, model="no-such-model")
    assert e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", top_p=5)
    # Parameters the server does not honour are refused by name, never dropped; malformed
    # constraints and tool choices are refused naming the field the client used.
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    bad_schema = {"type": "object", "properties": {"a": {"type": "frobnicate"}}}
    for kw, param in [
        # This server has no --enable-auto-tool-choice: tools with `auto` (the default) are refused.
        (dict(tools=[tool]), "tool_choice"),
        (dict(tools=[tool], tool_choice="auto"), "tool_choice"),
        (dict(tools=[tool], tool_choice={"type": "function", "function": {"name": "get_wether"}}), "tool_choice"),
        (
            dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": bad_schema}}),
            "response_format",
        ),
        (dict(extra_body={"guided_json": bad_schema}), "guided_json"),
        (
            dict(tools=[{"type": "function", "function": {"name": "f", "parameters": bad_schema}}], tool_choice="required"),
            "tools[0].function.parameters",
        ),
        (dict(extra_body={"guided_decoding_backend": "xgrammar"}), "guided_decoding_backend"),
    ]:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as e:
                chat(client, stream=stream, **kw)
            assert e.value.param == param, (kw, e.value.message)
            assert param.split(".")[0] in e.value.message
    # Still serving.
    assert chat(client).choices[0].message.role == "assistant"
