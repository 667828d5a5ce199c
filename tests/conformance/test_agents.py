"""A real agent framework end to end: the OpenAI Agents SDK (its chat-completions model)
drives `baton serve` on the default model through a loop of three tool calls with
`tool_choice="required"`, and the tools really run with valid arguments.

Reads BATON_SMOL_URL / BATON_SMOL_MODEL; run through tests/conformance/run.sh.
"""

import os
from typing import Literal

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    ToolsToFinalOutputResult,
    function_tool,
    set_tracing_disabled,
)
from openai import AsyncOpenAI

BASE_URL = os.environ.get("BATON_SMOL_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1"
MODEL = os.environ.get("BATON_SMOL_MODEL", "smollm2")
CITIES = ("Paris", "Tokyo", "Lima")


def test_agent_runs_a_loop_of_three_tool_calls():
    set_tracing_disabled(True)
    invoked = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], unit: Literal["celsius", "fahrenheit"]) -> str:
        """Current weather in a city."""
        invoked.append(("get_weather", city, unit))
        return f"18 degrees {unit} and sunny in {city}"

    @function_tool
    def get_time(city: Literal["Paris", "Tokyo", "Lima"]) -> str:
        """Local time in a city."""
        invoked.append(("get_time", city))
        return f"It is 10:00 in {city}"

    @function_tool
    def book_table(city: Literal["Paris", "Tokyo", "Lima"], people: Literal[1, 2, 3, 4]) -> str:
        """Books a restaurant table."""
        invoked.append(("book_table", city, people))
        return f"Booked for {people} in {city}"

    def stop_after_three(context, results) -> ToolsToFinalOutputResult:
        return ToolsToFinalOutputResult(is_final_output=len(invoked) >= 3, final_output=f"done after {len(invoked)}")

    client = AsyncOpenAI(base_url=BASE_URL, api_key="none", max_retries=0, timeout=600)
    agent = Agent(
        name="planner",
        instructions="Plan an evening: check the weather, the time, then book a table.",
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0, max_tokens=200),
        tools=[get_weather, get_time, book_table],
        tool_use_behavior=stop_after_three,
        reset_tool_choice=False,
    )
    result = Runner.run_sync(agent, "Plan my evening in Paris.", max_turns=6)
    assert result.final_output == "done after 3"
    assert len(invoked) == 3, invoked
    for call in invoked:
        assert call[0] in ("get_weather", "get_time", "book_table")
        assert call[1] in CITIES
    # Three model turns, each ending in exactly one call.
    responses = result.raw_responses
    assert len(responses) == 3
