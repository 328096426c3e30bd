"""Old import path of :mod:`mtpflow.backend.fusion` (the same module object)."""

import sys

from .backend import fusion

sys.modules[__name__] = fusion
