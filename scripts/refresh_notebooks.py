"""Re-execute the chapters in place and sync their install cells and the API page's causes table.

    python scripts/refresh_notebooks.py --help

The code, and its usage, is scripts/book_tools/refresh.py.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from book_tools.refresh import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
