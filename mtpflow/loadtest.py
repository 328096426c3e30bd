"""``python -m mtpflow.loadtest``: :mod:`mtpflow.serve.loadtest` (a bounded load test of ``mtpflow serve``)."""

import sys

from .serve.loadtest import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
