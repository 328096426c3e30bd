"""Old import path of :mod:`mtpflow.backend.blas` (the same module object)."""

import sys

from .backend import blas

sys.modules[__name__] = blas
