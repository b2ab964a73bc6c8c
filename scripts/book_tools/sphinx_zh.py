"""Sphinx extension: the Chinese edition (简体中文版), built with the English one and linked page to page.

Registered in ``_config.yml`` (``sphinx.local_extensions``: ``book_tools.sphinx_zh``, found in ``scripts/``)
and, through the generated ``zh/_config.yml``, in the Chinese build too; what it does depends on which of the
two it runs in.

- In the English build (source folder = the repository's root), when the HTML build has finished, it builds the
  Chinese tree ``zh/`` (written by ``scripts/translate_book.py``) with Jupyter Book in a second process, with
  the same ``-W``/``-n``/``--keep-going`` settings, and copies the result into ``<outdir>/zh/``: the README's
  one build command makes both editions. Set ``ZH_EDITION=0`` to build the English edition alone. A Chinese tree
  that is not what ``translate_book.py`` would write (the English changed since) is reported as a warning.
- In both builds, every page gets a link to the same page in the other language at the top of its content
  (and a ``<link rel="alternate" hreflang>`` in its head): ``book/x.html`` <-> ``zh/book/x.html``. A page
  without a twin links to the other edition's root page.
- In the Chinese build (``language = zh_CN``) the search index splits Chinese text into overlapping pairs of
  characters, in the index and in the reader's query (Sphinx's own Chinese splitter indexes no Chinese at all
  unless jieba is installed).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import time

from sphinx.application import Sphinx
from sphinx.errors import ExtensionError
from sphinx.search.zh import SearchChinese
from sphinx.util import logging

from .zh import render

logger = logging.getLogger(__name__)

ROOT = render.ROOT
ZH = render.ZH
LINK_CLASS = "edition-language-link"

_CJK = r"\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"


class BigramChinese(SearchChinese):
    """Sphinx's Chinese search, with runs of Chinese characters indexed as overlapping character pairs.

    "数值稳定" is indexed as 数值, 值稳, 稳定 (and a query is split the same way in the browser), so a search for
    any word of two or more characters finds the pages that contain it, with no dictionary.
    """

    import re as _re

    _run = _re.compile(f"[{_CJK}]+")
    js_splitter_code = (
        "function splitQuery(query) {\n"
        f"  const run = /[{_CJK}]+/g;\n"
        "  const out = [];\n"
        "  for (const m of query.matchAll(run)) {\n"
        "    const s = m[0];\n"
        "    if (s.length === 1) out.push(s);\n"
        "    for (let i = 0; i + 1 < s.length; i++) out.push(s.slice(i, i + 2));\n"
        "  }\n"
        f"  const rest = query.replace(run, ' ');\n"
        "  for (const w of rest.split(/[^\\p{L}\\p{N}_]+/gu)) if (w) out.push(w);\n"
        "  return out;\n"
        "}\n"
    )

    def split(self, input: str) -> list[str]:  # noqa: A002 (Sphinx's signature)
        pairs = []
        for run in self._run.findall(input):
            pairs.extend(run[i:i + 2] for i in range(len(run) - 1))
        return pairs + super().split(input)

    def stem(self, word: str) -> str:
        return word if self._run.fullmatch(word) else super().stem(word)


def _is_zh(app: Sphinx) -> bool:
    return pathlib.Path(app.srcdir).resolve() == ZH.resolve()


def _source_exists(folder: pathlib.Path, pagename: str) -> bool:
    return any((folder / f"{pagename}{ext}").is_file() for ext in (".md", ".ipynb"))


def twin_url(app: Sphinx, pagename: str) -> tuple[str, str]:
    """The relative URL of ``pagename``'s page in the other edition, and that edition's language code."""
    up = "../" * pagename.count("/")
    is_doc = pagename in app.env.all_docs
    if _is_zh(app):
        target = pagename
        if is_doc and not _source_exists(ROOT, pagename):
            target = app.config.root_doc  # a Chinese-only page (the glossary): the English root page
        return f"{up}../{target}.html", "en"
    target = pagename if not is_doc or _source_exists(ZH, pagename) else "book/intro"
    return f"{up}zh/{target}.html", "zh-CN"


def add_language_link(app: Sphinx, pagename: str, templatename: str, context: dict, doctree) -> None:
    if app.builder.format != "html" or "body" not in context:
        return
    url, lang = twin_url(app, pagename)
    text, title = ("English", "Read this page in English") if lang == "en" else ("中文", "阅读本页的中文版")
    link = (
        f'<p class="{LINK_CLASS}" style="text-align: right; margin: 0 0 0.5em; font-size: 0.9em">'
        f'<a href="{url}" hreflang="{lang}" lang="{lang}" title="{title}">'
        f'<i class="fas fa-language"></i> {text}</a></p>\n'
    )
    context["body"] = link + context["body"]
    context["metatags"] = context.get("metatags", "") + f'\n<link rel="alternate" hreflang="{lang}" href="{url}" />'


def _report_stale() -> None:
    try:
        differences = render.differences()
    except render.Untranslated as error:
        logger.warning(
            "the Chinese edition is stale: %d units of English text have no current translation "
            "(python scripts/translate_book.py --stale); the first: %s", len(error.problems), error.problems[0])
        return
    if differences:
        logger.warning("zh/ is not what scripts/translate_book.py writes (run it): %s", "; ".join(differences[:5]))


def build_chinese(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or _is_zh(app) or app.builder.name != "html":
        return
    if os.environ.get("ZH_EDITION", "1") == "0":
        logger.info("ZH_EDITION=0: the Chinese edition is not built")
        return
    if not (ZH / "_config.yml").is_file():
        raise ExtensionError("zh/_config.yml is missing: run python scripts/translate_book.py")
    _report_stale()
    outdir = pathlib.Path(app.outdir)
    work = outdir.parent / "zh_edition"  # jupyter-book writes <work>/_build/html, with its own cache
    command = [str(pathlib.Path(sys.executable).with_name("jupyter-book")), "build", str(ZH),
               "--path-output", str(work)]
    if not os.path.exists(command[0]):
        command[0:1] = [sys.executable, "-m", "jupyter_book.cli.main"]
    if app.warningiserror or app.keep_going:  # Sphinx sets keep_going only with -W (and then clears warningiserror)
        command.append("-W")
    if app.config.nitpicky:
        command.append("-n")
    if app.keep_going:
        command.append("--keep-going")
    logger.info("building the Chinese edition: %s", " ".join(command))
    start = time.perf_counter()
    sys.stdout.flush()
    sys.stderr.flush()
    result = subprocess.run(command, cwd=ROOT)
    if result.returncode != 0:
        raise ExtensionError(f"the Chinese edition failed to build (exit status {result.returncode}): {command}")
    target = outdir / "zh"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(work / "_build" / "html", target)
    logger.info("the Chinese edition is in %s (%.0f s)", target, time.perf_counter() - start)


#: The theme strings that come from the book's configuration, not from the theme's translations.
ZH_THEME_OPTIONS = {"search_bar_text": "搜索本书……"}


def translate_theme_options(app: Sphinx, config) -> None:
    if _is_zh(app):
        config.html_theme_options = {**(config.html_theme_options or {}), **ZH_THEME_OPTIONS}


def setup(app: Sphinx) -> dict:
    app.add_search_language(BigramChinese)
    app.connect("config-inited", translate_theme_options)
    app.connect("html-page-context", add_language_link, priority=900)
    app.connect("build-finished", build_chinese)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
