"""A config section that names no model on this machine is said once, not silently ignored.

`[models."smollm2"]` must apply when the demo runs, and a section whose name matches nothing
(a typo, a model not downloaded yet) would otherwise do nothing without a word. Its warning is
shown once per config file and section: the names already warned about are kept in the state
folder, so a config prepared for a model to download later does not warn on every run.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from llmcli.config.paths import state_dir
from llmcli.config.user_config import UserConfig

WARNED_FILE = "config-sections-warned"


def warn_about_unmatched_sections(config: UserConfig) -> None:
    if not config.models:
        return
    unmatched = [section for section in config.models if not _names_a_model(section, config)]
    if not unmatched:
        return
    from llmcli.frontends import terminal

    record = state_dir() / WARNED_FILE
    try:
        warned = set(record.read_text(encoding="utf-8").splitlines())
    except OSError:
        warned = set()
    for section in unmatched:
        key = f"{config.path}\t{section}"
        if key in warned:
            continue
        terminal.warning(
            f'[models."{section}"] in {config.path} names no model here (not in `llmcli models list`, '
            "not an alias, folder or file): it applies only once a model goes by that name"
        )
        warned.add(key)
    with contextlib.suppress(OSError):  # an unwritable state folder: say it again next time
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text("\n".join(sorted(warned)) + "\n", encoding="utf-8")


def _names_a_model(section: str, config: UserConfig) -> bool:
    from llmcli.models.catalog import model_names
    from llmcli.models.resolve import names_of

    known = {*names_of(None), *config.aliases, *config.aliases.values(), *model_names()}
    if section.lower() in {name.lower() for name in known}:
        return True
    return Path(section).expanduser().exists()
