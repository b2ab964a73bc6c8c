"""The release workflow's checks and inputs.

    python scripts/release.py --help

The code, and its usage, is scripts/book_tools/release.py.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from book_tools.release import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
