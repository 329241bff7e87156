"""``python -m m3_engine.server``: ``m3-serve``."""

import sys

from .cli import main

sys.exit(main())
