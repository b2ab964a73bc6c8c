"""The book's settings and pages: where things are, what ``_config.yml`` and ``_toc.yml`` say."""

from __future__ import annotations

import copy
import functools
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
BOOK = ROOT / "book"


def rel(path: pathlib.Path) -> str:
    """``path`` relative to the repository's root (as written in messages), or whole if outside it."""
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


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


def notebooks() -> list[pathlib.Path]:
    """Every chapter notebook of the book, sorted."""
    return sorted(
        p for p in BOOK.rglob("*.ipynb") if "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts
    )


#: The files that spell out the repository's or the book's URL (refresh.sync_links rewrites them).
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
