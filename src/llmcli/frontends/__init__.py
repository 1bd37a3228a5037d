"""Front ends: how users reach the engine (one-shot generation, the chat REPL)."""
