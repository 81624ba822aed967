"""Structured outputs against a running k3-serve with the official `openai` client: a Pydantic
model through `client.beta.chat.completions.parse` (the client sends it as a strict
`json_schema` response format and parses the answer back into the model), then a forced tool
call through `tools`/`tool_choice`, its arguments checked against the tool's parameters.

Usage: structured.py BASE_URL MODEL. The model's weights are random, so nothing but the shape
of the answers can be checked; thinking is off, greedy, a few seeds. Prints one JSON line and
exits non-zero if an answer does not parse or validate.
"""
import json
import sys
from typing import Literal

import openai
from pydantic import BaseModel, Field

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused")
no_think = {"chat_template_kwargs": {"thinking": False}}


class Item(BaseModel):
    kind: Literal["tool", "file", "note"]
    count: int = Field(ge=0, le=99)


class Plan(BaseModel):
    priority: Literal["low", "high"]
    items: list[Item] = Field(max_length=3)
    done: bool


parsed = []
for seed in range(3):
    completion = client.beta.chat.completions.parse(
        model=model,
        messages=[{"role": "user", "content": "Make a plan."}],
        response_format=Plan,
        max_tokens=200,
        temperature=0,
        seed=seed,
        extra_body=no_think,
    )
    message = completion.choices[0].message
    if message.parsed is None:
        sys.exit(f"seed {seed}: the answer did not parse into Plan: {message.content!r}")
    parsed.append(message.parsed.model_dump())

tools = [{
    "type": "function",
    "function": {
        "name": "move",
        "description": "Move the cursor.",
        "parameters": {
            "type": "object",
            "properties": {
                "direction": {"type": "string", "enum": ["up", "down"]},
                "steps": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["direction", "steps"],
            "additionalProperties": False,
        },
    },
}, {
    "type": "function",
    "function": {"name": "stop", "parameters": {"type": "object", "properties": {}}},
}]
calls = []
for seed in range(3):
    completion = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Move."}],
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "move"}},
        max_tokens=200,
        temperature=1,
        seed=seed,
        extra_body=no_think,
    )
    message = completion.choices[0].message
    if not message.tool_calls:
        sys.exit(f"seed {seed}: no tool call: {message}")
    call = message.tool_calls[0].function
    arguments = json.loads(call.arguments)
    if call.name != "move" or arguments.get("direction") not in ("up", "down") \
            or not isinstance(arguments.get("steps"), int) or not 1 <= arguments["steps"] <= 9 \
            or set(arguments) != {"direction", "steps"}:
        sys.exit(f"seed {seed}: the call does not match move's parameters: {call}")
    calls.append({"name": call.name, "arguments": arguments,
                  "finish_reason": completion.choices[0].finish_reason})

print(json.dumps({"openai": openai.__version__, "parsed": parsed, "calls": calls}))
