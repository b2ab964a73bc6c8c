"""The cells every chapter shares: the install cell, and what the book shows of a code cell."""

from __future__ import annotations

import re

from . import settings

# The first code cell of every chapter (the "install cell", historically the "Colab cell"): it
# installs the code the chapter runs (`install_ref`: a release's tag, or on a development
# version the repository's branch) wherever the package is not importable (Colab,
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


def install_ref(version: str | None = None) -> str:
    """The git ref whose code a chapter of this tree runs, and so what its install cell installs.

    A release (``0.2.0``) installs its tag, ``v0.2.0``; a development version (``0.2.0.dev0``: the
    changes under CHANGELOG.md's *Unreleased*) installs the repository's branch
    (``repository.branch`` of ``_config.yml``, ``main``), the code the chapters were run with.
    The release's tag is made from the commit ``python scripts/release.py cut`` writes.
    """
    from .release import is_release

    version = version or settings.package_version()
    return f"v{version}" if is_release(version) else settings.repository_branch()


def colab_install_spec(url: str | None = None, version: str | None = None) -> str:
    """The pip requirement the install cell and the install lines name: the code of :func:`install_ref`."""
    url = url or settings.repository_url()
    return f"nan-gradients-companion @ git+{url}@{install_ref(version)}"


#: The extra the install cell asks for: what the chapters import beside ``companion``
#: (matplotlib, mpmath), which a fresh environment may not have.
BOOK_EXTRA = "book"


def colab_cell_source(url: str | None = None, version: str | None = None) -> str:
    """Source of the first code cell of every chapter: install `companion`, with the ``book``
    extra (what the chapters import beside it), if it is missing."""
    name, code = colab_install_spec(url, version).split(" @ ")
    name = f"{name}[{BOOK_EXTRA}]"
    # The URL goes through a variable (IPython expands {code} in the magic's line) so that
    # no line of the cell is wider than the book's 88 characters.
    return (
        "# Installs companion, the code this notebook was run with (a release's tag, or the\n"
        "# development branch), where it is missing (Colab, Kaggle, Binder, a downloaded\n"
        "# notebook); nothing otherwise.\n"
        "import importlib.util\n"
        "\n"
        f"if {COLAB_MARKER}:\n"
        f'    code = "{code}"\n'
        f'    %pip install --quiet "{name} @ {{code}}"'
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
    match = re.search(r"git\+([^@\s\"]+)@", cell_source)
    return match.group(1) if match else None


def installed_ref(cell_source: str) -> str | None:
    """The git ref (tag or branch) an install cell installs, or None."""
    match = re.search(r"git\+[^@\s\"]+@([\w./-]+)", cell_source)
    return match.group(1) if match else None


#: What a page spells that depends on the version: an install line, and a Colab link into the
#: repository (README.md). Each names the ref of :func:`install_ref`; ``{url}`` and
#: ``{owner_repo}`` are filled in from ``repository.url``.
INSTALL_REF_PATTERNS = {
    "an install line": r"(git\+{url}@)([\w.-]+(?:/[\w.-]+)*?)(?=[\"'\s`]|$)",
    "a Colab link": r"(colab\.research\.google\.com/github/{owner_repo}/blob/)([\w.-]+)(?=/)",
}
#: The pages whose install lines and Colab links follow the version (the CHANGELOG's links are history).
INSTALL_REF_PAGES = ("README.md", "companion/README.md", "book/**/*.md")


def _install_ref_patterns() -> dict[str, re.Pattern]:
    url = settings.repository_url()
    owner_repo = re.sub(r"^https?://github\.com/", "", url).removesuffix(".git")
    return {kind: re.compile(pattern.format(url=re.escape(url), owner_repo=re.escape(owner_repo)), re.M)
            for kind, pattern in INSTALL_REF_PATTERNS.items()}


def install_ref_pages() -> list:
    pages = []
    for pattern in INSTALL_REF_PAGES:
        pages.extend(p for p in settings.ROOT.glob(pattern) if "_build" not in p.parts)
    return sorted(pages)


def install_refs_in_pages() -> list[tuple[object, list[tuple[str, str]]]]:
    """(page, [(kind, ref), ...]) for every page of INSTALL_REF_PAGES that names a ref to install or open."""
    found = []
    for page in install_ref_pages():
        text = page.read_text()
        refs = [(kind, m.group(2)) for kind, pattern in _install_ref_patterns().items() for m in pattern.finditer(text)]
        if refs:
            found.append((page, refs))
    return found


def with_install_ref(text: str, ref: str | None = None) -> str:
    """``text`` with every install line and Colab link naming ``ref`` (default :func:`install_ref`)."""
    ref = ref or install_ref()
    for pattern in _install_ref_patterns().values():
        text = pattern.sub(lambda m: m.group(1) + ref, text)
    return text
