"""Helpers shared by the contributor scripts and the tests: the Colab cell, the book's settings.

Not part of the ``companion`` package: nothing here is needed to *use* the book's code.
"""

from __future__ import annotations

import copy
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
BOOK = ROOT / "book"
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


def package_version() -> str:
    """``companion.__version__``, read from its single source without importing TensorFlow."""
    text = (ROOT / "companion" / "_version.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)


@functools.lru_cache(maxsize=8)
def _parsed_yaml(text: str):
    import yaml

    return yaml.safe_load(text)


def config() -> dict:
    """``_config.yml``, parsed once for each content it has had (translate_book.py asks for the
    repository's URL for every unit of text it hashes: parsing it each time took seconds)."""
    return copy.deepcopy(_parsed_yaml((ROOT / "_config.yml").read_text()))


def repository_url() -> str:
    """``repository.url`` of ``_config.yml``: the one setting to change when publishing a fork."""
    return config()["repository"]["url"].rstrip("/")


def pages_url(url: str | None = None) -> str:
    """Where GitHub Pages publishes the book of ``repository.url``: ``https://<owner>.github.io/<repo>/``.

    ``html.baseurl`` in ``_config.yml`` (canonical URLs, OpenGraph, sitemap) must be this URL.
    """
    owner, repo = re.sub(r"^https?://github\.com/", "", url or repository_url()).removesuffix(".git").split("/")[:2]
    return f"https://{owner.lower()}.github.io/{repo}/"


def html_baseurl() -> str:
    return (config().get("html") or {}).get("baseurl", "")


def repository_branch() -> str:
    return config()["repository"].get("branch", "main")


def path_to_book() -> str:
    """``repository.path_to_book`` of ``_config.yml``: where the book's root is inside the repository."""
    return (config()["repository"].get("path_to_book") or "").strip("/")


def colab_launch_url(notebook: pathlib.Path) -> str:
    """The URL that opens ``notebook`` (a path under ROOT) in Colab from the configured repository and branch."""
    owner_repo = re.sub(r"^https?://github\.com/", "", repository_url()).removesuffix(".git")
    path = notebook.resolve().relative_to(ROOT).as_posix()
    if path_to_book():
        path = f"{path_to_book()}/{path}"
    return f"https://colab.research.google.com/github/{owner_repo}/blob/{repository_branch()}/{path}"


def toc_sources() -> list[pathlib.Path]:
    """The source file (.md or .ipynb) of every page in ``_toc.yml``, root first, in reading order."""
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    entries = [toc["root"]]

    def walk(items):
        for item in items:
            if "file" in item:
                entries.append(item["file"])
            walk(item.get("chapters", []) + item.get("sections", []))

    walk(toc.get("parts", []) + toc.get("chapters", []))
    sources = []
    for entry in entries:
        found = [ROOT / f"{entry}{ext}" for ext in (".md", ".ipynb") if (ROOT / f"{entry}{ext}").exists()]
        if found:
            sources.append(found[0])
    return sources


def colab_install_spec(url: str | None = None, version: str | None = None) -> str:
    """The pip requirement the Colab cell installs: the tagged release of this version."""
    url = url or repository_url()
    version = version or package_version()
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


def notebooks() -> list[pathlib.Path]:
    """Every chapter notebook of the book, sorted."""
    return sorted(
        p for p in BOOK.rglob("*.ipynb") if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts
    )


def first_code_cell(nb: dict) -> dict | None:
    return next((c for c in nb["cells"] if c["cell_type"] == "code"), None)


LINKED_PAGES = (
    "README.md",
    "CHANGELOG.md",
    "CONTRIBUTING.md",
    "CITATION.cff",
    "pyproject.toml",
    "_config.yml",
    "companion/README.md",
    ".github/ISSUE_TEMPLATE/*.yml",
    "book/**/*.md",
)


def linked_pages() -> list[pathlib.Path]:
    """The files that spell out the repository URL or the book's URL (the notebooks get it from their Colab cell)."""
    pages = []
    for pattern in LINKED_PAGES:
        pages.extend(p for p in ROOT.glob(pattern) if "_build" not in p.parts)
    return sorted(pages)


def installed_url(cell_source: str) -> str | None:
    """The repository URL a Colab cell installs from, or None."""
    match = re.search(r"git\+(\S+?)@v", cell_source)
    return match.group(1) if match else None


def with_repository_branch(config_text: str, branch: str) -> str:
    """``_config.yml``'s text with ``repository.branch`` set to ``branch`` (comments kept).

    The release workflow builds the book from a tag with ``branch`` = the tag, so that the
    launch buttons open the notebooks of the release whose version the install cells name.
    """
    if not re.fullmatch(r"[\w./-]+", branch):
        raise ValueError(f"branch must be a git ref name, got {branch!r}")
    pattern = re.compile(r"^(repository:\n(?:[ \t]+.*\n|[ \t]*\n)*?[ \t]+branch:[ \t]*)\S+", re.M)
    new, count = pattern.subn(lambda m: m.group(1) + branch, config_text, count=1)
    if count != 1:
        raise ValueError("_config.yml has no repository.branch setting")
    return new


def changelog_entry(version: str, changelog: str | None = None) -> str:
    """The body of ``CHANGELOG.md``'s section ``## [version] - date`` (without its heading).

    Raises:
        ValueError: if the changelog has no dated section for ``version``.
    """
    text = changelog if changelog is not None else (ROOT / "CHANGELOG.md").read_text()
    match = re.search(rf"^## \[{re.escape(version)}\] - \d{{4}}-\d{{2}}-\d{{2}}[ \t]*\n(.*?)(?=^## |^\[[^\]]+\]: |\Z)",
                      text, re.M | re.S)
    if not match or not match.group(1).strip():
        raise ValueError(f"CHANGELOG.md has no dated entry `## [{version}] - YYYY-MM-DD` with content")
    return match.group(1).strip() + "\n"


# --- Exercises and their solutions -------------------------------------------------------
# A chapter's exercises are markdown paragraphs that start with `**Exercise N.**`; each
# solution is one or more code cells whose source starts with `# Solution`, then, if it
# has one, its explanation: the markdown that follows them up to the next exercise or
# heading. A solution is hidden whole until the reader opens it:
#
# - its code cells carry the tag `hide-cell` (the book shows one collapsed toggle for the
#   code and its output together, labelled "Solution to exercise N: show the code and its
#   output" through myst-nb's cell metadata; nbval and Colab run the cell as usual);
# - its explanation is wrapped in `<details class="solution"><summary>...</summary>`, which
#   the book (MyST passes the HTML through; book/_static/companion.css styles it), Jupyter
#   and Colab all show collapsed, with the markdown and math inside rendered when opened.
#
# scripts/hide_solutions.py applies this to every chapter (idempotent; it changes only
# tags and these wrappers, never a cell's output); tests/book/test_book.py checks it.

SOLUTION_CODE_TAG = "hide-cell"
SOLUTION_OPEN = '<details class="solution">'
SOLUTION_CLOSE = "</details>"
_EXERCISE = re.compile(r"^\*\*Exercise (\d+)\.\*\*", re.M)
_HEADING = re.compile(r"^#{1,6} ", re.M)
_DETAILS = re.compile(
    r'<details class="solution">\s*<summary>(?P<title>.*?)</summary>\s*(?P<body>.*?)\s*</details>', re.S
)
# A MyST admonition or dropdown whose title starts with "Solution" (the wrapper of the
# first edition, shown as raw text in Jupyter and Colab).
_ADMONITION = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{(?:admonition|dropdown)\}[ \t]*(?P<title>Solution[^\n]*)\n"
    r"(?P<options>(?::[\w-]+:[^\n]*\n)*)(?P<body>.*?)\n(?P=fence)[ \t]*$",
    re.S | re.M,
)


def is_solution_code(cell: dict) -> bool:
    """Whether ``cell`` is a code cell of a solution (its source starts with ``# Solution``)."""
    return cell.get("cell_type") == "code" and "".join(cell["source"]).lstrip().startswith("# Solution")


def split_solution_text(source: str) -> tuple[str, str]:
    """A markdown cell that follows a solution: (its explanation, the rest from the next exercise or heading on)."""
    starts = [m.start() for m in (_EXERCISE.search(source), _HEADING.search(source)) if m]
    cut = min(starts) if starts else len(source)
    return source[:cut], source[cut:]


def solution_details(title: str, body: str) -> str:
    """An explanation wrapped so that it is hidden until opened."""
    return f"{SOLUTION_OPEN}\n<summary>{title.strip()}</summary>\n\n{body.strip()}\n\n{SOLUTION_CLOSE}"


def _is_wrapped(text: str) -> bool:
    match = _DETAILS.fullmatch(text.strip())
    return bool(match) and SOLUTION_OPEN not in match.group("body")


def _exercise_number(cells: list[dict], index: int) -> str | None:
    """The number of the last exercise stated before cell ``index``."""
    for cell in reversed(cells[:index]):
        if cell["cell_type"] == "markdown":
            numbers = _EXERCISE.findall("".join(cell["source"]))
            if numbers:
                return numbers[-1]
    return None


def _hidden(text: str, default_title: str) -> str:
    """``text`` (an explanation) as one hidden block; earlier wrappers are unwrapped first."""
    if _is_wrapped(text):
        return text.strip()
    titles = [m.group("title") for m in _ADMONITION.finditer(text)] + [m.group("title") for m in _DETAILS.finditer(text)]
    body = _ADMONITION.sub(lambda m: m.group("body").strip(), text)
    body = _DETAILS.sub(lambda m: m.group("body").strip(), body)
    return solution_details(titles[0] if titles else default_title, body)


def hide_solutions(nb: dict) -> list[str]:
    """Hide every solution of ``nb`` in place; return what changed (empty: nothing to do).

    Only the tags of solution code cells and the wrapper around solution explanations
    change; sources of code cells and every output stay as they are.
    """
    changes = []
    cells = nb["cells"]
    after_solution = False
    for index, cell in enumerate(cells):
        if cell["cell_type"] == "code":
            after_solution = is_solution_code(cell)
            if after_solution:
                tags = cell.setdefault("metadata", {}).get("tags", [])
                new = [t for t in tags if t not in ("hide-input", "hide-output")]
                if SOLUTION_CODE_TAG not in new:
                    new.append(SOLUTION_CODE_TAG)
                if new != tags:
                    cell["metadata"]["tags"] = new
                    changes.append(f"code cell {index}: tags {tags} -> {new}")
                number = _exercise_number(cells, index)
                name = f"Solution to exercise {number}" if number else "Solution"
                # The toggle's label in the book (myst-nb's cell-level code_prompt_show/hide).
                prompts = {"code_prompt_show": f"{name}: show the code and its output",
                           "code_prompt_hide": f"{name}: hide"}
                mystnb = cell["metadata"].get("mystnb", {})
                if any(mystnb.get(key) != value for key, value in prompts.items()):
                    cell["metadata"]["mystnb"] = {**mystnb, **prompts}
                    changes.append(f"code cell {index}: toggle labelled {prompts['code_prompt_show']!r}")
            continue
        if cell["cell_type"] != "markdown":
            continue
        source = "".join(cell["source"])
        if after_solution:
            explanation, rest = split_solution_text(source)
            after_solution = not rest
        else:
            explanation, rest = "", source
        number = _exercise_number(cells, index)
        title = f"Solution to exercise {number}, in words" if number else "Solution, in words"
        new_source = _hidden(explanation, title) if explanation.strip() else ""
        # A first-edition dropdown elsewhere (a solution without code) is converted too.
        rest = _ADMONITION.sub(lambda m: solution_details(m.group("title"), m.group("body")), rest)
        new_source = "\n\n".join(part.strip("\n") for part in (new_source, rest) if part.strip())
        if new_source != source.strip("\n"):  # a real change, not just the cell's last newline
            cell["source"] = new_source
            changes.append(f"markdown cell {index}: solution hidden")
    return changes


def solution_problems(nb: dict) -> list[str]:
    """Every solution of ``nb`` that a reader sees before opening it (empty: all hidden)."""
    problems = []
    after_solution = False
    for index, cell in enumerate(nb["cells"]):
        source = "".join(cell["source"])
        if cell["cell_type"] == "code":
            after_solution = is_solution_code(cell)
            tags = set(cell.get("metadata", {}).get("tags", []))
            if after_solution and (SOLUTION_CODE_TAG not in tags or tags & {"remove-cell", "remove-input"}):
                problems.append(f"code cell {index} (a solution) is not tagged {SOLUTION_CODE_TAG}: {sorted(tags)}")
            continue
        if cell["cell_type"] != "markdown":
            continue
        if _ADMONITION.search(source):
            problems.append(f"markdown cell {index}: a solution in a MyST dropdown (raw text in Jupyter and Colab)")
        if after_solution:
            explanation, rest = split_solution_text(source)
            after_solution = not rest
            if explanation.strip() and not _is_wrapped(explanation):
                problems.append(f"markdown cell {index}: solution text outside {SOLUTION_OPEN}: "
                                f"{explanation.strip()[:60]!r}")
    return problems


# --- the API page's table of the doctor's causes ----------------------------------------------
# Generated from companion.diagnostics.CAUSES, the one definition of the causes:
# `python scripts/refresh_notebooks.py --no-execute` rewrites it, and
# tests/book/test_cause_sections.py fails while the page differs from what this renders.
API_PAGE = BOOK / "reference" / "api.md"
CAUSES_TABLE_HEADER = "| cause | what happened | fix | shown in |"


def causes_table() -> str:
    """The markdown table of every cause: name, description, fix and a link to its section."""
    from companion.diagnostics.causes import CAUSES

    rows = [CAUSES_TABLE_HEADER, "|---|---|---|---|"]
    for name, cause in CAUSES.items():
        chapter, _, anchor = cause.section.partition("#")
        page = chapter.removeprefix("book/")
        link = f"[{pathlib.PurePosixPath(page).name.replace('_', ' ')}](../{page}.ipynb#{anchor})"
        rows.append(f"| `{name}` | {cause.description} | {cause.fix} | {link} |")
    return "\n".join(rows)


def with_causes_table(page: str) -> str:
    """The API page's text with its causes table (the lines from the header on) rendered anew."""
    lines = page.split("\n")
    start = lines.index(CAUSES_TABLE_HEADER)
    end = start
    while end < len(lines) and lines[end].startswith("|"):
        end += 1
    return "\n".join(lines[:start] + causes_table().split("\n") + lines[end:])
