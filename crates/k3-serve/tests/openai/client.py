"""A streamed chat against a running k3-serve with the official `openai` client, then two
default (non-streamed) chats: with thinking off the answer is in `message.content`; with
thinking on (the default) the reasoning is in `message.reasoning_content`, as docs/SERVING.md says.

Usage: client.py BASE_URL MODEL. Prints one JSON line: the chunks seen, the text, the finish
reason, the two answers' fields; exits non-zero if the stream is malformed or a field is not
where it belongs.
"""
import json
import sys

import openai

base_url, model = sys.argv[1], sys.argv[2]
client = openai.OpenAI(base_url=base_url, api_key="unused")
stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": "Say something."}],
    stream=True,
    max_tokens=12,
    temperature=0.8,
    seed=5,
)
chunks, text, finish = 0, "", None
for chunk in stream:
    chunks += 1
    choice = chunk.choices[0]
    delta = choice.delta
    text += (delta.content or "") + (getattr(delta, "reasoning_content", None) or "")
    if choice.finish_reason:
        finish = choice.finish_reason
models = [m.id for m in client.models.list()]

# The tiny model's weights are random, so only where the text lands is checked, not what it
# says; greedy and 16 tokens make each answer the same on every run.
messages = [{"role": "user", "content": "Say something."}]
off = client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0,
    extra_body={"chat_template_kwargs": {"thinking": False}},
).choices[0].message
on = client.chat.completions.create(
    model=model, messages=messages, max_tokens=16, temperature=0,
).choices[0].message
report = {
    "chunks": chunks, "text": text, "finish_reason": finish, "models": models,
    "openai": openai.__version__,
    "thinking_off": {"content": off.content,
                     "reasoning_content": getattr(off, "reasoning_content", None)},
    "thinking_on": {"content": on.content,
                    "reasoning_content": getattr(on, "reasoning_content", None)},
}
print(json.dumps(report))
if chunks == 0 or finish not in ("length", "stop"):
    sys.exit(1)
if not off.content or getattr(off, "reasoning_content", None):
    sys.exit("thinking off: the answer is not all in message.content")
if not getattr(on, "reasoning_content", None):
    sys.exit("thinking on: no message.reasoning_content")
