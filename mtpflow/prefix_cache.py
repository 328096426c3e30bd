"""``mtpflow.prefix_cache``: :mod:`mtpflow.serve.prefix_cache` (prefix caching across requests)."""

from .serve.prefix_cache import PrefixCache

__all__ = ["PrefixCache"]
