"""Tools a hosted API runs on its own servers (OpenAI's web_search and file_search, Anthropic's
web_search_… and code_execution_…): a local server has nothing to run them with. One rule for
every protocol: refused by name, or, with `llmcli serve --drop-hosted-tools` (for clients that
always send them, as Codex and Claude Code send a web search), left out, and the server says so
once per tool type on its stderr, whichever protocol named it."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

from llmcli.errors import LlmcliError


class HostedToolRefused(LlmcliError):
    """A hosted tool in a server that does not drop them: a 400 in the route's shape."""


@dataclass
class HostedTools:
    """What the server does with hosted tools: refuse them (the default) or drop them, saying so
    once per type. One per server, shared by its protocols."""

    drop: bool = False
    warned: set[str] = field(default_factory=set)

    def left_out(self, kind: str, refusal: str) -> None:
        """A hosted tool of type `kind` is left out of a request, or, where the server does not
        drop them, refused with `refusal` (the protocol's words for why it cannot run here)."""
        if not self.drop:
            raise HostedToolRefused(f"{refusal} (start it with --drop-hosted-tools to leave such tools out)")
        if kind not in self.warned:
            self.warned.add(kind)
            print(
                f"llmcli serve: leaving out the {kind} tools requests send (--drop-hosted-tools)",
                file=sys.stderr,
                flush=True,
            )
