"""Hide every exercise solution until the reader opens it.

    python scripts/hide_solutions.py --help

The code, and its usage, is scripts/book_tools/solutions.py.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from book_tools.solutions import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
