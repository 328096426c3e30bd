"""mtpflow: multi-token-prediction speculative decoding on MLX.

Importing this package is cheap: it does not import ``mlx`` or change the
process environment.  Heavy modules are imported by the functions that need
them.
"""

from __future__ import annotations

import pluggy

__version__ = "0.1.0"

#: Marker for hook implementations: ``from mtpflow import hookimpl``.
hookimpl = pluggy.HookimplMarker("mtpflow")

__all__ = ["__version__", "hookimpl"]
