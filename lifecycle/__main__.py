"""``python -m lifecycle``: the ``kv-lifecycle`` command line."""

import sys

from lifecycle.cli import main

sys.exit(main())
