"""Write the Chinese edition zh/ from the English sources and the stored translations.

    python scripts/translate_book.py --help

The code, and its usage, is scripts/book_tools/zh/.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from book_tools.zh.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
