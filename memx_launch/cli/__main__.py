"""``python -m memx_launch.cli``: the ``memx`` command."""

import sys

from memx_launch.cli.main import main

sys.exit(main())
