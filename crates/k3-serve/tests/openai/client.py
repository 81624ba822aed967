"""A streamed chat against a running k3-serve with the official `openai` client.

Usage: client.py BASE_URL MODEL. Prints one JSON line: the chunks seen, the text, the finish
reason; exits non-zero if the stream is malformed.
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
print(json.dumps({"chunks": chunks, "text": text, "finish_reason": finish, "models": models,
                  "openai": openai.__version__}))
if chunks == 0 or finish not in ("length", "stop"):
    sys.exit(1)
