"""The K/V hand-over mask of the Gemma 4 assistant (shared with the generic
assistant: :func:`mtpflow.drafters.kv_sharing.drafter_mask`)."""

from ..kv_sharing import drafter_mask  # noqa: F401  (re-exported)
