"""``python -m attnpool``: the command line (:mod:`attnpool.tools.cli`)."""

import sys

from .tools.cli import main

sys.exit(main())
