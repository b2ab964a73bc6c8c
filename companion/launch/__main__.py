"""``python -m companion.launch``: see :mod:`companion.launch.cli`."""

import sys

from companion.launch.cli import main

sys.exit(main())
