"""What drafter kinds share: the recommended block size a checkpoint carries."""

from __future__ import annotations

import json
from pathlib import Path


def recommended_block_size(config: dict, path: str | Path | None = None) -> int | None:
    """The block size (drafts + 1) a drafter checkpoint recommends, if any.

    Read, in order, from ``config.json``'s ``block_size`` (mtpflow's own
    drafters; mlx-vlm's DFlash reading), ``dflash_config.block_size``
    (z-lab's DFlash format) and ``generation_config.json``'s
    ``num_assistant_tokens`` (transformers' assisted generation: drafts per
    round, so the block is one more).
    """
    for value in (config.get("block_size"), (config.get("dflash_config") or {}).get("block_size")):
        if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
            return value
    if path is not None:
        gen = Path(path) / "generation_config.json"
        if gen.is_file():
            try:
                n = json.loads(gen.read_text()).get("num_assistant_tokens")
            except (json.JSONDecodeError, AttributeError):
                n = None
            if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                return n + 1
    return None
