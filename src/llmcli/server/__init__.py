"""`llmcli serve`: the engine kept warm behind an OpenAI-compatible HTTP API, and the client side
that `generate` uses to reach it (or any other OpenAI-compatible server)."""
