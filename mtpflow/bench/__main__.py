"""``python -m mtpflow.bench``: the bench's own command line (as ``mtpflow bench``)."""

import sys

from .run import main

sys.exit(main())
