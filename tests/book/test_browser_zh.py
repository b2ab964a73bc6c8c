"""The Chinese edition of the built book (zh/, built into _build/html/zh/ by the README's build command).

Without a browser: every page of both editions links to its twin in the other one, and back; the Chinese pages
are marked Chinese (`lang`, titles) and their Colab buttons open the Chinese notebooks.

In headless Chromium (as tests/book/test_browser.py drives it; skipped without it unless CI_REQUIRE_BROWSER=1): a
Chinese chapter reads as Chinese, in the theme's own strings too, its language link leads to the English twin
and that page's link back, its Colab link opens the Chinese notebook, and the Chinese search finds a Chinese word.
"""

from __future__ import annotations

import html.parser
import pathlib
import re
import urllib.parse

import pytest

import book_tools
from book_tools.zh import render
from test_browser import _file_path, browser  # noqa: F401 (the fixture, shared)

pytestmark = pytest.mark.slow

CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")
CHAPTER = book_tools.ROOT / "book" / "case_a" / "reproduce.ipynb"


class _Page(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.lang = None
        self.title = ""
        self.links: list[str] = []
        self.language_link = None
        self._in_title = False
        self._in_language_p = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "html":
            self.lang = attrs.get("lang")
        elif tag == "title":
            self._in_title = True
        elif tag == "p" and "edition-language-link" in (attrs.get("class") or ""):
            self._in_language_p = True
        elif tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])
            if self._in_language_p and self.language_link is None:
                self.language_link = attrs["href"]

    def handle_endtag(self, tag):
        if tag == "title":
            self._in_title = False
        elif tag == "p":
            self._in_language_p = False

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def _parse(path: pathlib.Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    return page


def _zh_html(built_book, source: pathlib.Path) -> pathlib.Path:
    return built_book.html / "zh" / source.relative_to(book_tools.ROOT).with_suffix(".html")


def _target(page: pathlib.Path, href: str) -> pathlib.Path:
    return (page.parent / urllib.parse.urlsplit(href).path).resolve()


def test_the_build_made_both_editions(built_book):
    assert built_book.returncode == 0, built_book.log
    for source in book_tools.toc_sources():
        assert built_book.page(source).is_file(), source
        assert _zh_html(built_book, source).is_file(), f"no Chinese page for {source.relative_to(book_tools.ROOT)}"
    assert (built_book.html / "zh" / "book" / "glossary.html").is_file()


@pytest.mark.parametrize("source", book_tools.toc_sources(), ids=lambda p: str(p.relative_to(book_tools.ROOT)))
def test_every_page_links_to_its_twin_in_the_other_language_and_back(built_book, source):
    english, chinese = built_book.page(source), _zh_html(built_book, source)
    en_page, zh_page = _parse(english), _parse(chinese)
    assert en_page.language_link, f"{english} has no link to the Chinese edition"
    assert _target(english, en_page.language_link) == chinese.resolve()
    assert zh_page.language_link, f"{chinese} has no link to the English edition"
    assert _target(chinese, zh_page.language_link) == english.resolve()
    assert zh_page.lang and zh_page.lang.startswith("zh"), f"{chinese}: lang={zh_page.lang!r}"
    assert en_page.lang == "en"
    assert CJK.search(zh_page.title), f"{chinese}: the title {zh_page.title!r} is not Chinese"


@pytest.mark.parametrize("source", book_tools.toc_sources(), ids=lambda p: str(p.relative_to(book_tools.ROOT)))
def test_every_section_of_an_english_page_has_its_anchor_on_the_chinese_page(built_book, source):
    """A link to page#section (the API page's table of causes has them) lands on that section in both editions."""
    english = built_book.page(source).read_text(encoding="utf-8")
    chinese = _zh_html(built_book, source).read_text(encoding="utf-8")
    sections = re.findall(r'<section id="([^"]+)"', english)
    ids = set(re.findall(r'\bid="([^"]+)"', chinese))
    missing = [s for s in sections[1:] if s not in ids]  # the first is the page's title
    assert not missing, f"sections of {source.name} without an anchor on its Chinese page: {missing}"


@pytest.mark.parametrize("source", [p for p in book_tools.toc_sources() if p.suffix == ".ipynb"],
                         ids=lambda p: str(p.relative_to(book_tools.ROOT)))
def test_chinese_page_launches_the_chinese_notebook_in_colab(built_book, source):
    colab = [href for href in _parse(_zh_html(built_book, source)).links if "colab.research.google.com" in href]
    expected = book_tools.colab_launch_url(render.zh_path(source))
    assert colab == [expected], f"Colab links {colab}, expected {expected}"
    assert "/blob/" in expected and expected.endswith("zh/" + source.relative_to(book_tools.ROOT).as_posix())


_FACTS = """
const article = document.querySelector("article.bd-article");
const prose = Array.from(article.querySelectorAll("p, li, h1, h2, h3, td, th"))
    .filter((e) => !e.closest("pre, .cell_output, .highlight, mjx-container"))
    .map((e) => e.innerText).join("\\n");
const link = document.querySelector("p.edition-language-link a");
const colab = Array.from(document.querySelectorAll("a[href*='colab.research.google.com']")).map((a) => a.href);
const chrome = Array.from(document.querySelectorAll(".bd-header, .bd-sidebar-primary, .prev-next-area, footer"))
    .map((e) => e.innerText + " " + Array.from(e.querySelectorAll("[placeholder], [aria-label], [title]"))
        .map((x) => x.getAttribute("placeholder") || x.getAttribute("aria-label") || x.getAttribute("title"))
        .join(" ")).join("\\n");
return {lang: document.documentElement.lang, title: document.title, prose: prose,
        language: link ? link.href : null, colab: colab, chrome: chrome};
"""


def _cjk_share(text: str) -> float:
    letters = re.findall(r"[A-Za-z]|[\u3400-\u4dbf\u4e00-\u9fff]", text)
    return sum(bool(CJK.match(c)) for c in letters) / max(1, len(letters))


def test_a_chinese_chapter_in_the_browser(browser, built_book):  # noqa: F811 (the fixture)
    english = built_book.page(CHAPTER).resolve()
    chinese = _zh_html(built_book, CHAPTER).resolve()
    browser.get(chinese.as_uri())
    facts = browser.execute_script(_FACTS)
    assert facts["lang"].startswith("zh"), facts["lang"]
    assert CJK.search(facts["title"]), facts["title"]
    # Its text is Chinese: most letters of its prose are Chinese characters (code and outputs stay English).
    assert _cjk_share(facts["prose"]) > 0.5, facts["prose"][:500]
    # The theme's own strings (navigation, search, previous/next, footer) are Chinese too.
    for word in ("搜索", "上一页", "下一页"):
        assert word in facts["chrome"], f"the theme's {word!r} is missing: {facts['chrome'][:300]}"
    assert facts["colab"] == [book_tools.colab_launch_url(render.zh_path(CHAPTER))]

    # Its language link leads to the English twin, and that page's link back here.
    browser.get(facts["language"])
    assert _file_path(browser.current_url) == english
    back = browser.execute_script(_FACTS)
    assert back["lang"] == "en" and _cjk_share(back["prose"]) < 0.05
    browser.get(back["language"])
    assert _file_path(browser.current_url) == chinese


def test_the_chinese_search_finds_chinese_words(browser, built_book):  # noqa: F811 (the fixture)
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    search = (built_book.html / "zh" / "search.html").resolve().as_uri()
    found = {}
    for query in ("梯度", "数值稳定", "上溢"):
        browser.get(f"{search}?q={urllib.parse.quote(query)}")
        WebDriverWait(browser, 60).until(
            lambda d: d.find_elements(By.CSS_SELECTOR, "#search-results p.search-summary, #search-results .search-summary")
        )
        WebDriverWait(browser, 60).until(
            lambda d: "Searching" not in d.find_element(By.ID, "search-results").text
            and "正在搜索" not in d.find_element(By.ID, "search-results").text
        )
        found[query] = len(browser.find_elements(By.CSS_SELECTOR, "#search-results ul.search li"))
    assert all(count > 0 for count in found.values()), f"search results per query: {found}"
