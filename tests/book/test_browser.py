"""The built book in a real browser, as a reader opens it: headless Chromium starts at
`_build/html/index.html` (over file://, as after the README's build command), follows the
"next" link through every chapter, and on every page checks that

- it renders: a screenshot of the article is not blank;
- its figures are there: every image in the article loaded, at least one per figure
  that the chapter's notebook holds;
- its links resolve: every link into the book names a built file (and an anchor on it);
- its math renders offline: every formula became MathJax output, without TeX errors
  or leftover TeX source, with the fonts loaded;
- it needs no network: the browser's name resolution and proxy lead nowhere, and every
  request the page makes is for a local file;

and that every page fits the window (`test_every_page_fits_the_window`): at 1280 px no code
block, output, table or display equation scrolls sideways (book_tools.CODE_WIDTH characters
of code fit, book/_static/companion.css), and at a phone's 390 px the page itself never
scrolls sideways (a wide block scrolls inside itself).

The reader's walk is at 1280 px by 1000 px, and what it finds of the width there is the
1280 px test's (`reader_walk`): every page is loaded once for both, not once each (a page
takes about a second to load and render). The phone's width is a walk of its own, each page
loaded at that width.

Chromium and its driver are Debian's (`apt-get install chromium chromium-driver`; `.ci/run`
installs them), driven by selenium without its download manager. Without them the test is
skipped, unless CI_REQUIRE_BROWSER=1 (set by `.ci/run`), where it fails.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pathlib
import re
import shutil
import urllib.parse
import urllib.request

import numpy as np
import pytest

import book_tools

pytestmark = pytest.mark.slow

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)
CHROMEDRIVER = shutil.which("chromedriver") or ("/usr/bin/chromedriver" if os.path.exists("/usr/bin/chromedriver") else None)

# Chromium flags: headless, no sandbox (CI runs as root), no first-run or background traffic,
# and no network: every host name resolves to nothing and every proxied request goes to a
# closed local port, so a page that needed a CDN would fail its checks here.
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-default-apps",
    "--disable-sync",
    "--no-first-run",
    "--no-default-browser-check",
    "--window-size=1280,1000",
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
    "--proxy-server=http://127.0.0.1:9",
    "--proxy-bypass-list=<-loopback>",
]

# Console errors that are not the book's: sphinx-thebe (pulled in by Jupyter Book 1) writes
# its `const THEBE_JS_URL` config script twice into every page. It is used only when a
# reader starts live code, which this book does not configure.
KNOWN_CONSOLE_ERRORS = [re.compile(r"Identifier 'THEBE_JS_URL' has already been declared")]

LOCAL_SCHEMES = {"file", "data", "blob", "about"}


def _require_browser():
    missing = [name for name, found in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not found]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium (pip install -r requirements.txt)")
    if missing:
        reason = f"no browser to test the book in: {', '.join(missing)} missing (apt-get install chromium chromium-driver)"
        if os.environ.get("CI_REQUIRE_BROWSER") == "1":
            pytest.fail(reason + "; CI_REQUIRE_BROWSER=1")
        pytest.skip(reason)


@pytest.fixture(scope="module")
def browser():
    _require_browser()
    os.environ["SE_OFFLINE"] = "true"  # selenium-manager must never download a driver or browser
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    driver.set_script_timeout(60)
    yield driver
    driver.quit()


def _png_pixels(png: bytes) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(io.BytesIO(png), format="png")[..., :3]


def _figures_in(notebook: pathlib.Path) -> int:
    return sum(
        any(kind.startswith("image/") for kind in output.get("data", {}))
        for cell in json.loads(notebook.read_text())["cells"]
        for output in cell.get("outputs", [])
    )


_IDS: dict[pathlib.Path, set[str]] = {}


def _ids_of(path: pathlib.Path) -> set[str]:
    if path not in _IDS:
        _IDS[path] = set(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))
    return _IDS[path]


_WAIT_FOR_RENDERING = """
const done = arguments[arguments.length - 1];
const typeset = (window.MathJax && MathJax.startup && MathJax.startup.promise) || Promise.resolve();
typeset.then(() => document.fonts.ready).then(() => done(true), (error) => done(String(error)));
"""

_PAGE_FACTS = """
const article = document.querySelector("article.bd-article") || document.body;
const images = Array.from(article.querySelectorAll("img"));
const fonts = Array.from(document.fonts).filter((f) => f.family.startsWith("MJX"));
const next = document.querySelector("a.right-next");
return {
    url: location.href,
    title: document.title,
    links: Array.from(document.querySelectorAll("a[href]")).map((a) => a.href),
    images: images.map((img) => ({src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0})),
    mathSource: document.querySelectorAll(".math").length,
    mathRendered: document.querySelectorAll(".math mjx-container, mjx-container.MathJax").length,
    mathErrors: document.querySelectorAll("mjx-merror, [data-mjx-error]").length,
    text: article.innerText,
    mathjaxLoaded: !!(window.MathJax && MathJax.startup),
    fontErrors: fonts.filter((f) => f.status === "error").map((f) => f.family),
    next: next ? next.href : null,
};
"""


def _file_path(url: str) -> pathlib.Path:
    return pathlib.Path(urllib.request.url2pathname(urllib.parse.urlsplit(url).path))


def _check_page(driver, html_root: pathlib.Path, source: pathlib.Path, shots: pathlib.Path) -> tuple[dict, list[str]]:
    """Checks one loaded page; returns its facts and its problems (none: it passed)."""
    from selenium.webdriver.common.by import By

    rendering = driver.execute_async_script(_WAIT_FOR_RENDERING)
    facts = driver.execute_script(_PAGE_FACTS)
    page = str(source.relative_to(book_tools.ROOT))
    problems = []
    if rendering is not True:
        problems.append(f"rendering failed: {rendering}")

    # It renders: the article's screenshot has ink and many colours, not one blank area.
    article = driver.find_element(By.CSS_SELECTOR, "article.bd-article")
    png = article.screenshot_as_png
    (shots / (page.replace("/", "__") + ".png")).write_bytes(png)
    pixels = _png_pixels(png)
    rgb = (pixels * 255).astype(np.uint32)
    colours = len(np.unique(rgb[..., 0] << 16 | rgb[..., 1] << 8 | rgb[..., 2]))
    ink = float((pixels.mean(axis=2) < 0.5).mean())
    if pixels.shape[0] < 100 or colours < 16 or ink < 0.002:
        problems.append(f"looks blank: {pixels.shape[1]}x{pixels.shape[0]} px, {colours} colours, {ink:.4f} ink")

    # Its figures are present.
    broken = [img["src"] for img in facts["images"] if not img["ok"]]
    if broken:
        problems.append(f"images that did not load: {broken}")
    if source.suffix == ".ipynb":
        figures = _figures_in(source)
        loaded = sum(img["ok"] for img in facts["images"])
        if loaded < figures:
            problems.append(f"{loaded} images loaded, but the notebook has {figures} figures")

    # Its internal links resolve, anchors included.
    for link in sorted(set(facts["links"])):
        parts = urllib.parse.urlsplit(link)
        if parts.scheme != "file":
            continue
        target = _file_path(link)
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file() or not target.resolve().is_relative_to(html_root):
            problems.append(f"broken link: {link}")
        elif parts.fragment and target.suffix == ".html":
            anchor = urllib.parse.unquote(parts.fragment)
            if anchor not in _ids_of(target):
                problems.append(f"broken anchor: {link}")

    # Its math renders, offline.
    if facts["mathSource"]:
        if not facts["mathjaxLoaded"]:
            problems.append("the page has math but MathJax did not load")
        if facts["mathRendered"] < facts["mathSource"]:
            problems.append(f"{facts['mathRendered']} of {facts['mathSource']} formulas rendered by MathJax")
        if facts["mathErrors"]:
            problems.append(f"{facts['mathErrors']} formulas with TeX errors")
        if facts["fontErrors"]:
            problems.append(f"MathJax fonts that failed to load: {facts['fontErrors']}")
        leftover = re.findall(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{", facts["text"])
        if leftover:
            problems.append(f"unrendered TeX left in the text: {leftover[:5]}")

    # Nothing went wrong in the console, and nothing went to the network.
    for entry in driver.get_log("browser"):
        if entry["level"] == "SEVERE" and not any(p.search(entry["message"]) for p in KNOWN_CONSOLE_ERRORS):
            problems.append(f"console error: {entry['message']}")
    for entry in driver.get_log("performance"):
        message = json.loads(entry["message"])["message"]
        if message["method"] == "Network.requestWillBeSent":
            url = message["params"]["request"]["url"]
            if urllib.parse.urlsplit(url).scheme not in LOCAL_SCHEMES:
                problems.append(f"network request: {url}")

    return facts, [f"{page} ({facts['url']}):"] + problems if problems else []


@dataclasses.dataclass
class ReaderWalk:
    """What the walk from index.html along the "next" links found."""

    visited: list[pathlib.Path]  # the sources of the pages it checked, in its order
    problems: list[str]  # _check_page's, page by page
    wrong_turn: str | None  # where a link (index.html's redirect, a "next") led off the toc
    last_next: str | None  # the "next" link of the last page checked
    overflows: dict[pathlib.Path, dict]  # each checked page's _OVERFLOWS, at 1280 px by 1000 px


#: The viewport of the reader's walk and of the 1280 px test, which it serves.
DESKTOP = {"width": 1280, "height": 1000, "deviceScaleFactor": 1, "mobile": False}


@pytest.fixture(scope="module")
def reader_walk(browser, built_book, tmp_path_factory) -> ReaderWalk:
    """Opens index.html at 1280 px by 1000 px and follows the "next" links through the toc,
    checking each page (`_check_page`) and measuring what scrolls sideways (`_OVERFLOWS`)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    html_root = built_book.html.resolve()
    expected = book_tools.toc_sources()
    shots = tmp_path_factory.mktemp("screenshots")
    walk = ReaderWalk([], [], None, None, {})
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", DESKTOP)
    try:
        browser.get((html_root / "index.html").as_uri())  # redirects to the root page of the toc
        first = (html_root / built_book.page(expected[0]).relative_to(built_book.html)).as_uri()
        try:
            WebDriverWait(browser, 30).until(lambda d: d.current_url.split("#")[0] == first)
        except TimeoutException:
            walk.wrong_turn = f"index.html led to {browser.current_url}, not to {first}"
            return walk
        for source in expected:
            url = browser.current_url.split("#")[0]
            if url != built_book.page(source).resolve().as_uri():
                walk.wrong_turn = (
                    f"after {[str(p.relative_to(book_tools.ROOT)) for p in walk.visited]}, the 'next' link led to "
                    f"{url}, not to the page of {source.relative_to(book_tools.ROOT)}"
                )
                break
            facts, problems = _check_page(browser, html_root, source, shots)
            walk.problems += problems
            walk.overflows[source] = browser.execute_script(_OVERFLOWS)
            walk.visited.append(source)
            walk.last_next = facts["next"]
            if facts["next"] is None:
                break
            browser.get(facts["next"])
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    return walk


def test_a_reader_can_follow_every_chapter_from_index_html(reader_walk):
    assert reader_walk.wrong_turn is None, reader_walk.wrong_turn
    problems = reader_walk.problems
    assert not problems, "\n  ".join(problems)
    expected = book_tools.toc_sources()
    assert reader_walk.visited == expected, "the 'next' links stop before the end of the table of contents"
    assert reader_walk.last_next is None, f"the last page links on to {reader_walk.last_next}"


# --- Width: what a reader sees at 1280 px and on a phone ---------------------------------

_OVERFLOWS = """
const article = document.querySelector("article.bd-article");
const name = (element) => {
    const text = (element.innerText || element.textContent || "").trim().split("\\n")[0];
    return text.slice(0, 60);
};
const wide = (element) => element.scrollWidth > element.clientWidth + 1;
const blocks = [];
article.querySelectorAll("pre").forEach((pre, index) => {
    if (wide(pre)) blocks.push({kind: "code block", index, scroll: pre.scrollWidth, client: pre.clientWidth, text: name(pre)});
});
article.querySelectorAll("table").forEach((table, index) => {
    const box = table.parentElement;
    if (table.getBoundingClientRect().width > box.clientWidth + 1 || wide(box))
        blocks.push({kind: "table", index, scroll: Math.round(table.getBoundingClientRect().width),
                     client: box.clientWidth, text: name(table)});
});
article.querySelectorAll('mjx-container[display="true"]').forEach((math, index) => {
    if (wide(math) || math.getBoundingClientRect().right > article.getBoundingClientRect().right + 1)
        blocks.push({kind: "display equation", index, scroll: math.scrollWidth, client: math.clientWidth, text: name(math)});
});
const root = document.documentElement;
return {page: {scroll: root.scrollWidth, client: root.clientWidth}, blocks};
"""


# What may still scroll sideways, by page and block ("book/x.ipynb: table 5"): nothing
# (issue 22 emptied it). A block that scrolls fails the test unless it is listed here, and
# a listed one that fits fails it too, so the list can only shrink.
KNOWN_OVERFLOWS = {
    1280: set(),
    390: set(),
}


@pytest.mark.parametrize(("width", "phone"), [(1280, False), (390, True)], ids=["1280px", "390px-phone"])
def test_every_page_fits_the_window(browser, built_book, request, width, phone):
    """At 1280 px nothing scrolls sideways; on a phone only wide blocks do, inside themselves."""
    # At 1280 px, the reader's walk measured the pages it reached (loading each at 1280 px by
    # 1000 px, as this would); a page it did not reach is loaded here.
    measured = request.getfixturevalue("reader_walk").overflows if width == DESKTOP["width"] else {}
    # A phone: the viewport of one (Chromium's own window cannot be narrower than 500 px).
    metrics = {**DESKTOP, "width": width, "height": 844, "mobile": True} if phone else DESKTOP
    browser.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", metrics)
    problems = []
    try:
        for source in book_tools.toc_sources():
            page = str(source.relative_to(book_tools.ROOT))
            facts = measured.get(source)
            if facts is None:
                browser.get(built_book.page(source).resolve().as_uri())
                browser.execute_async_script(_WAIT_FOR_RENDERING)
                facts = browser.execute_script(_OVERFLOWS)
            if facts["page"]["scroll"] > facts["page"]["client"]:
                problems.append(f"{page}: the page scrolls sideways ({facts['page']['scroll']} px in "
                                f"{facts['page']['client']} px)")
            if not phone:
                problems += [
                    f"{page}: {b['kind']} {b['index']} scrolls sideways ({b['scroll']} px in {b['client']} px): "
                    f"{b['text']!r}"
                    for b in facts["blocks"]
                ]
    finally:
        browser.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    known = KNOWN_OVERFLOWS[width]
    new_problems = [p for p in problems if not any(p.startswith(k + " ") for k in known)]
    assert not new_problems, f"at {width} px ({len(new_problems)}):\n  " + "\n  ".join(new_problems)
    fixed = sorted(k for k in known if not any(p.startswith(k + " ") for p in problems))
    assert not fixed, f"at {width} px these fit now: remove them from KNOWN_OVERFLOWS: {fixed}"
