"""``python -m edgeswarm`` is the ``edgeswarm`` command."""

import sys

from edgeswarm.cli.main import main

sys.exit(main())
