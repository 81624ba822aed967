//! The deployable k3 binary (CLI, OpenAI-compatible HTTP server with SSE, engine thread running batched decode) — filled in by the serve issue.
