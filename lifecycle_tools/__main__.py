"""``python -m lifecycle_tools``: the ``kv-lifecycle`` command line."""

import sys

from lifecycle_tools.cli import main

sys.exit(main())
