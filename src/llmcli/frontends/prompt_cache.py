"""The prompt cache on disk, attached to an engine a front end made (generate, chat, serve):
the folder, the size and the key are settled here, the entries kept by engine/disk_prefix.py."""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmcli.config.paths import prompt_cache_dir
from llmcli.config.settings import prompt_cache_bytes
from llmcli.frontends import terminal

if TYPE_CHECKING:
    from llmcli.config.settings import LoadSettings
    from llmcli.engine.held import HeldCache
    from llmcli.models.load import LoadedModel


def attach_disk_cache(engine: HeldCache, loaded: LoadedModel, load: LoadSettings) -> None:
    """Give `engine`'s prefix store its disk tier, unless the cache is off (size 0), the model's
    files are not known (nothing to key its entries by) or its backend keeps no copies."""
    budget = prompt_cache_bytes(load.prompt_cache_size)
    if budget == 0 or loaded.fingerprint is None:
        return
    from llmcli.engine.native.saved_tensors import disk_tier_for

    facts = {
        "model": loaded.fingerprint,
        "dtype": loaded.dtype_name,
        "quant": loaded.quant,
        "quant_backend": loaded.quant_backend,
    }
    engine.prefixes.disk = disk_tier_for(engine.backend, facts, budget, prompt_cache_dir(), terminal.warning)
