"""The cells every chapter shares: the install cell, and what the book shows of a code cell."""

from __future__ import annotations

import re

from . import settings

# The first code cell of every chapter (the "install cell", historically the "Colab cell"): it
# installs the matching release of `companion` wherever the package is not importable (Colab,
# Kaggle, Binder, a downloaded notebook) and nothing otherwise. nbval skips it; the book
# shows it collapsed (`hide-input`), so that a reader of the web page sees how to install.
COLAB_TAGS = ["nbval-skip", "hide-input"]
COLAB_MARKER = 'importlib.util.find_spec("companion") is None'
#: Markers of earlier versions of the install cell, so that the refresh script replaces them.
LEGACY_COLAB_MARKERS = ('"google.colab" in sys.modules',)


#: The widest line of code or text output a chapter may have: what the book shows, without
#: scrolling, in a code block at a window 1280 px wide (book/_static/companion.css widens
#: code blocks to it; tests/book/test_browser.py measures it, tests/book/test_book.py counts it).
CODE_WIDTH = 88
#: The longest visible code cell, in lines; longer cells are exceptions listed in
#: tests/book/test_book.py until they shrink (a plot or drawing goes behind `hide-input`).
CODE_CELL_LINES = 25


def shown_text_lines(cell: dict) -> list[tuple[str, str]]:
    """(where, line) for every line the book shows of a code cell in a monospace block.

    Its source (unless hidden by `remove-input`/`remove-cell`), its stdout, and each
    result shown as text (a result that has an HTML or image form is shown as that).
    """
    tags = set(cell.get("metadata", {}).get("tags", []))
    if cell.get("cell_type") != "code" or "remove-cell" in tags:
        return []
    lines = [] if "remove-input" in tags else [("source", line) for line in "".join(cell["source"]).splitlines()]
    if "remove-output" in tags:
        return lines
    for output in cell.get("outputs", []):
        if output["output_type"] == "stream" and output.get("name") == "stdout":
            lines += [("stdout", line) for line in "".join(output["text"]).splitlines()]
        elif output["output_type"] in ("execute_result", "display_data"):
            data = output.get("data", {})
            if "text/plain" in data and not any(k == "text/html" or k.startswith("image/") for k in data):
                lines += [("result", line) for line in "".join(data["text/plain"]).splitlines()]
        elif output["output_type"] == "error":
            lines += [("error", line) for line in f"{output['ename']}: {output['evalue']}".splitlines()]
    return lines


def colab_install_spec(url: str | None = None, version: str | None = None) -> str:
    """The pip requirement the Colab cell installs: the tagged release of this version."""
    url = url or settings.repository_url()
    version = version or settings.package_version()
    return f"nan-gradients-companion @ git+{url}@v{version}"


def colab_cell_source(url: str | None = None, version: str | None = None) -> str:
    """Source of the first code cell of every chapter: install `companion` if it is missing."""
    name, release = colab_install_spec(url, version).split(" @ ")
    # The release goes through a variable (IPython expands {release} in the magic's line)
    # so that no line of the cell is wider than the book's 88 characters.
    return (
        "# Installs companion, at the version this book was built with, where it is\n"
        "# missing (Colab, Kaggle, Binder, a downloaded notebook); nothing otherwise.\n"
        "import importlib.util\n"
        "\n"
        f"if {COLAB_MARKER}:\n"
        f'    release = "{release}"\n'
        f'    %pip install --quiet "{name} @ {{release}}"'
    )


def is_colab_cell(cell: dict | None) -> bool:
    """Whether ``cell`` is the install cell, in its current or an earlier version."""
    if cell is None or cell.get("cell_type") != "code":
        return False
    source = "".join(cell["source"])
    return any(marker in source for marker in (COLAB_MARKER, *LEGACY_COLAB_MARKERS))


def first_code_cell(nb: dict) -> dict | None:
    return next((c for c in nb["cells"] if c["cell_type"] == "code"), None)


def installed_url(cell_source: str) -> str | None:
    """The repository URL a Colab cell installs from, or None."""
    match = re.search(r"git\+(\S+?)@v", cell_source)
    return match.group(1) if match else None
