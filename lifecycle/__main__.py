"""``python -m lifecycle``: kept for compatibility; the command lives in ``lifecycle_tools``.

Only runs when executed as a script: ``import lifecycle`` never loads it, so the library itself
never imports the tools.
"""

import sys

from lifecycle_tools.cli import main

sys.exit(main())
