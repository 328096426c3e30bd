"""``mtpflow export`` of a native MTP head: the family's native layout (the
loader contract in :mod:`mtpflow.drafters.native_mtp`)."""

from __future__ import annotations

from pathlib import Path

#: formats ``mtpflow export`` writes for this kind (:mod:`mtpflow.export`)
FORMATS = ("native",)


def export_drafter(session, out, fmt: str = "native", *, verifier_name: str | None = None,
                   speculative_tokens: int = 3, dtype: str | None = None) -> Path:
    """The loaded head's layers as ``model.layers.{N+i}.*`` with the target's
    config plus ``num_nextn_predict_layers``: a folder ``--draft-model`` loads."""
    from .train import save_native

    return save_native(session.drafter.model, session.target, out, dtype)
