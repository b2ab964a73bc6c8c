"""The built book's HTML: launch buttons that open the right notebook, an API page that
covers every public name of `companion`, and math that needs no CDN.

All tests here share the session's one build (the `built_book` fixture, tests/conftest.py).
"""

from __future__ import annotations

import html.parser
import importlib
import inspect
import pkgutil
import re

import pytest

import book_tools
import companion

pytestmark = pytest.mark.slow

NOTEBOOKS = book_tools.notebooks()
PAGES = book_tools.toc_sources()


class _Links(html.parser.HTMLParser):
    """Every <a href>, <script src> and element id of a page."""

    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []
        self.scripts: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "id" in attrs:
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.hrefs.append(attrs["href"])
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])


def _parse(path) -> _Links:
    parser = _Links()
    parser.feed(path.read_text())
    return parser


def _rel(path) -> str:
    return str(path.relative_to(book_tools.ROOT))


# --- Colab launch buttons -------------------------------------------------------------------


def test_launch_url_is_derived_from_the_repository_setting():
    url = book_tools.colab_launch_url(book_tools.ROOT / "book" / "x" / "y.ipynb")
    owner_repo = book_tools.repository_url().removeprefix("https://github.com/")
    assert url == (
        f"https://colab.research.google.com/github/{owner_repo}/blob/{book_tools.repository_branch()}/book/x/y.ipynb"
    )


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[_rel(p) for p in NOTEBOOKS])
def test_notebook_page_launches_that_very_notebook_in_colab(built_book, notebook):
    page = built_book.page(notebook)
    assert page.is_file(), f"{_rel(notebook)} has no page in the built book: is it in _toc.yml?"
    colab = [h for h in _parse(page).hrefs if h.startswith("https://colab.research.google.com/")]
    expected = book_tools.colab_launch_url(notebook)
    assert colab == [expected], f"{_rel(page)}: Colab launch links {colab}, expected [{expected}]"
    # The URL names a notebook that is in the repository, at the path the URL gives.
    path_in_repo = expected.split(f"/blob/{book_tools.repository_branch()}/", 1)[1]
    assert (book_tools.ROOT / path_in_repo.removeprefix(book_tools.path_to_book() + "/")).is_file()


def test_pages_without_a_notebook_have_no_colab_button(built_book):
    for source in PAGES:
        if source.suffix == ".md":
            hrefs = _parse(built_book.page(source)).hrefs
            assert not [h for h in hrefs if "colab.research.google.com" in h], f"{_rel(source)} has a Colab button"


def test_repository_button_links_to_the_configured_repository(built_book):
    url = book_tools.repository_url()
    for source in PAGES:
        assert url in _parse(built_book.page(source)).hrefs, f"{_rel(source)}: no link to {url}"


# --- API reference --------------------------------------------------------------------------

API_PAGE = book_tools.BOOK / "reference" / "api.md"


def _public_submodules() -> list[str]:
    """The library's public modules and the book's (``book.<name>``); not the old names'
    stubs of companion._moved, which are the book's modules themselves."""
    import companion.book
    from companion import _moved

    stubs = {name.split(".")[-1] for name in _moved.MOVED}
    top = [m.name for m in pkgutil.iter_modules(companion.__path__)
           if not m.name.startswith("_") and m.name not in stubs and m.name != "book"]
    book = [f"book.{m.name}" for m in pkgutil.iter_modules(companion.book.__path__) if not m.name.startswith("_")]
    return sorted(top) + sorted(book)


def _public_names(module) -> list[str]:
    names = getattr(module, "__all__", None)
    assert names is not None, f"{module.__name__} has no __all__: its public names are not declared"
    return list(names)


def test_every_public_submodule_is_exported_and_on_the_api_page():
    submodules = _public_submodules()
    top = {name.split(".")[0] for name in submodules}
    assert top <= set(companion.__all__), f"companion.__all__ lacks the submodules {sorted(top - set(companion.__all__))}"
    documented = re.findall(r"^\.\. automodule:: (companion\.[\w.]+)$", API_PAGE.read_text(), re.M)
    documented = [name for name in documented if name != "companion.book"]
    assert sorted(documented) == sorted(f"companion.{m}" for m in submodules), (
        "book/reference/api.md must have one `.. automodule::` per public submodule of companion"
    )


@pytest.mark.parametrize("submodule", _public_submodules())
def test_every_public_name_is_documented_on_the_api_page(built_book, submodule):
    module = importlib.import_module(f"companion.{submodule}")
    ids = _parse(built_book.page(API_PAGE)).ids
    missing = [n for n in _public_names(module) if f"companion.{submodule}.{n}" not in ids]
    assert not missing, f"the API page has no entry for companion.{submodule}.{missing}"
    for name in _public_names(module):
        obj = getattr(module, name)
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"companion.{submodule}.{name} has no docstring"


# --- MathJax ships with the book ------------------------------------------------------------


def test_math_is_rendered_by_the_bundled_mathjax_not_a_cdn(built_book):
    pages_with_math = 0
    for source in PAGES:
        page = built_book.page(source)
        scripts = _parse(page).scripts
        assert not [s for s in scripts if re.match(r"(https?:)?//", s) and "mathjax" in s.lower()], (
            f"{_rel(page)} loads MathJax from the network"
        )
        mathjax = [s for s in scripts if "mathjax" in s.lower()]
        if mathjax:
            pages_with_math += 1
            target = (page.parent / mathjax[0].split("?")[0]).resolve()
            assert target.is_file() and target.is_relative_to(built_book.html / "_static"), (
                f"{_rel(page)}: MathJax script {mathjax[0]} does not resolve to a file of the built book"
            )
            fonts = target.parent / "output" / "chtml" / "fonts" / "woff-v2"
            assert len(list(fonts.glob("*.woff"))) > 10, f"MathJax's fonts are missing from {fonts}"
    assert pages_with_math >= 5, "the chapters' math should load MathJax"


# --- source links, sharing metadata, sitemap, licences --------------------------------------


def _source_link(api_html: str, anchor: str) -> str | None:
    """The [source] link of the API entry with this id, or None."""
    start = api_html.find(f'id="{anchor}"')
    if start < 0:
        return None
    signature = api_html[start:api_html.index("</dt>", start)]
    match = re.search(r'href="([^"]*_modules/[^"]*)"><span class="viewcode-link">', signature)
    return match.group(1) if match else None


@pytest.mark.parametrize("submodule", _public_submodules())
def test_every_public_function_and_class_links_to_its_source(built_book, submodule):
    module = importlib.import_module(f"companion.{submodule}")
    page = built_book.page(API_PAGE)
    api_html = page.read_text()
    for name in _public_names(module):
        obj = getattr(module, name)
        if not (inspect.isfunction(obj) or inspect.isclass(obj)):
            continue  # constants have no source location of their own
        link = _source_link(api_html, f"companion.{submodule}.{name}")
        assert link, f"companion.{submodule}.{name} has no [source] link on the API page"
        target, _, anchor = link.partition("#")
        source_page = (page.parent / target).resolve()
        assert source_page.is_file() and source_page.is_relative_to(built_book.html / "_modules"), link
        # The link lands on the highlighted definition, in the module that defines it.
        assert f'<div class="viewcode-block" id="{anchor}">' in source_page.read_text(), link
        defining = inspect.getmodule(obj).__name__
        assert source_page == (built_book.html / "_modules" / (defining.replace(".", "/") + ".html")).resolve()


class _Head(html.parser.HTMLParser):
    """The <meta property=...>, <meta name=...> and <link rel=canonical> of a page."""

    def __init__(self):
        super().__init__()
        self.meta: dict[str, str] = {}
        self.canonical: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "meta" and (attrs.get("property") or attrs.get("name")):
            self.meta.setdefault(attrs.get("property") or attrs.get("name"), attrs.get("content", ""))
        if tag == "link" and attrs.get("rel") == "canonical":
            self.canonical = attrs["href"]


@pytest.mark.parametrize("source", PAGES, ids=[_rel(p) for p in PAGES])
def test_every_page_has_a_canonical_url_and_opengraph_metadata(built_book, source):
    page = built_book.page(source)
    head = _Head()
    head.feed(page.read_text())
    url = book_tools.pages_url() + page.relative_to(built_book.html).as_posix()
    assert head.canonical == url, f"{_rel(page)}: canonical {head.canonical}, expected {url}"
    assert head.meta.get("og:url") == url
    assert head.meta.get("og:title"), f"{_rel(page)} has no og:title"
    assert head.meta.get("og:site_name") == "NaN gradients in TensorFlow"
    assert len(head.meta.get("og:description", "")) > 40, f"{_rel(page)}: no useful og:description"
    image = head.meta.get("og:image", "")
    assert image.startswith(book_tools.pages_url()), f"{_rel(page)}: og:image {image!r} is not an absolute URL"
    # The social card is an image the build drew, and it is published with the book.
    card = built_book.html / image.removeprefix(book_tools.pages_url())
    assert card.is_file() and card.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{_rel(page)}: no card at {card}"


def test_sitemap_lists_every_page_of_the_book(built_book):
    sitemap = built_book.html / "sitemap.xml"
    assert sitemap.is_file(), "the build wrote no sitemap.xml"
    urls = set(re.findall(r"<loc>([^<]+)</loc>", sitemap.read_text()))
    for source in PAGES:
        url = book_tools.pages_url() + built_book.page(source).relative_to(built_book.html).as_posix()
        assert url in urls, f"sitemap.xml does not list {url}"
    assert all(u.startswith(book_tools.pages_url()) for u in urls)
    assert not {u for u in urls if u.endswith(("/search.html", "/genindex.html"))}


def test_every_page_names_the_book_and_code_licences(built_book):
    for source in PAGES:
        hrefs = _parse(built_book.page(source)).hrefs
        assert "https://creativecommons.org/licenses/by/4.0/" in hrefs, f"{_rel(source)}: no CC BY 4.0 link"
        assert f"{book_tools.repository_url()}/blob/main/LICENSE" in hrefs, f"{_rel(source)}: no MIT licence link"


# --- Hidden solutions -------------------------------------------------------------------


class _Solutions(html.parser.HTMLParser):
    """For every solution on a page: whether it sits inside a closed <details>."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, bool]] = []  # (tag, is a details element that starts closed)
        self.code: list[bool] = []  # per "# Solution" comment of a code cell: hidden?
        self.texts = 0  # <details class="solution"> elements
        self.open_solutions = 0  # of those, shown open

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag in ("br", "img", "hr", "input", "meta", "link", "wbr"):
            return
        closed_details = tag == "details" and "open" not in attrs
        if tag == "details" and "solution" in (attrs.get("class") or "").split():
            self.texts += 1
            self.open_solutions += "open" in attrs
        self.stack.append((tag, closed_details))

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()[0] == tag:
                break

    def handle_data(self, data):
        if data.startswith("# Solution"):
            self.code.append(any(closed for _, closed in self.stack))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=[_rel(p) for p in NOTEBOOKS])
def test_every_solution_is_collapsed_on_its_page(built_book, notebook):
    import json

    cells = json.loads(notebook.read_text())["cells"]
    code = sum(book_tools.is_solution_code(c) for c in cells)
    texts = sum("".join(c["source"]).count(book_tools.SOLUTION_OPEN) for c in cells if c["cell_type"] == "markdown")
    parser = _Solutions()
    parser.feed(built_book.page(notebook).read_text())
    assert len(parser.code) == code, f"{_rel(notebook)}: {len(parser.code)} solution code cells on the page, {code} in it"
    assert all(parser.code), f"{_rel(notebook)}: solution code shown before it is opened: {parser.code}"
    assert (parser.texts, parser.open_solutions) == (texts, 0), f"{_rel(notebook)}: solution texts shown"
