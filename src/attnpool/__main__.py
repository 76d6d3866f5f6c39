"""``python -m attnpool``: the command line (:mod:`attnpool.cli`)."""

import sys

from .cli import main

sys.exit(main())
