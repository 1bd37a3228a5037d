"""Which target a command talks to: a running server that fits, else the model loaded here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcli.config.settings import LoadSettings, RemoteSettings, SpeculativeSettings

if TYPE_CHECKING:
    from llmcli.frontends.protocols import Target


def open_target(
    model: str | None,
    load: LoadSettings,
    remote: RemoteSettings,
    speculative: SpeculativeSettings,
    in_process: bool = False,
    lean: bool = True,
) -> Target:
    """A running server that fits (or the one named), else the model loaded here (`lean`: it
    will run on the native engine only, so it may load without transformers)."""
    from llmcli.frontends.remote import find_server

    found = find_server(model, load, remote, in_process, speculative)
    if found is not None:
        return found
    from llmcli.frontends.loading import load_with_feedback
    from llmcli.frontends.local import InProcessTarget

    loaded = load_with_feedback(model, load, lean=lean, mtp=speculative.method == "mtp")
    return InProcessTarget(loaded, model, load, speculative)
