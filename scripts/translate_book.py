"""Write the Chinese edition (简体中文版) of the book from the English sources and the stored translations.

    python scripts/translate_book.py             # write zh/ (fails, naming each cell, on a missing or stale translation)
    python scripts/translate_book.py --check     # write nothing; fail if zh/ is not what this script would write
    python scripts/translate_book.py --stale     # list every missing or stale translation, with the English it needs
    python scripts/translate_book.py --export book/case_a/reproduce.ipynb > units.txt      # the English units, to translate
    python scripts/translate_book.py --import book/case_a/reproduce.ipynb < units.zh.txt   # store translations

One set of chapters, two languages. Every page of the book (each source that ``_toc.yml`` lists) has a
translation store beside it, ``<page>.zh.json`` (``book/case_a/reproduce.ipynb`` ->
``book/case_a/reproduce.zh.json``). It holds one entry per *unit* of English text: a markdown cell of a notebook
(keyed by the cell's id) or a block of a markdown page (keyed ``b<index>``; blocks are separated by blank lines,
fenced code blocks kept whole). Each entry keeps the SHA-256 of the English text it translates, that English text
(so that ``--stale`` can show what changed), and the Chinese text; the repository's and the book's URLs are kept as
placeholders, so that a fork's other ``repository.url`` needs no new translation. ``_site.zh.json`` at the root holds the book's
title, the part captions of ``_toc.yml`` and the footer.

The Chinese tree mirrors the English one under ``zh/`` (``zh/book/case_a/reproduce.ipynb``), so that every page
has the same path in both editions (the built site puts the Chinese one under ``zh/``):

- a notebook is the English notebook with each markdown cell's source replaced by its translation: code cells,
  their outputs, execution counts and every metadata field are the English notebook's, byte for byte (the file is
  written exactly as nbformat writes the English one);
- a markdown page is the translations of its blocks, joined as the English blocks are;
- in both, each glossary term (``book/glossary.zh.md``) gets its English once per page, at its first use in
  running text, and a line break between two Chinese characters is removed (a browser shows it as a space;
  the stores keep the translations wrapped as they were written);
- ``zh/_config.yml`` is ``_config.yml`` with the Chinese title, ``language: zh_CN``, the site's URLs under
  ``zh/`` and the paths made relative to ``zh/``; ``zh/_toc.yml`` is ``_toc.yml`` with Chinese captions and
  the glossary page (``book/glossary.zh.md``, written in Chinese only) added;
- ``book/references.bib`` is copied.

A unit's translation is looked up by its key and the hash of its current English text; failing that, by the hash
alone (a cell that moved, a block that shifted). When neither matches, the translation is *missing* (no entry for
the key) or *stale* (the English changed after it was translated), and writing fails naming the page and the
cell. ``tests/book/test_translations.py`` checks the same and that the Chinese notebooks' code and outputs are the
English ones.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import difflib
import hashlib
import json
import os
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import book_tools  # noqa: E402

ROOT = book_tools.ROOT
ZH = ROOT / "zh"
SITE_STORE = ROOT / "_site.zh.json"
GLOSSARY_SOURCE = ROOT / "book" / "glossary.zh.md"
GLOSSARY_DOC = "book/glossary"
COPIED = ("book/references.bib",)
STORE_SUFFIX = ".zh.json"
MARKER = "%%% unit "  # the line that opens a unit in --export/--import files
SAME = "="  # a unit imported as this one line is stored as its English text (code, a module's directive)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _site_urls() -> list[tuple[str, str]]:
    """The repository's and the book's URL (from _config.yml), each with the placeholder the stores use."""
    url = book_tools.repository_url()
    return [(url, "<<REPOSITORY_URL>>"), (book_tools.pages_url(url), "<<PAGES_URL>>")]


def normalize(text: str) -> str:
    """``text`` with the site's URLs as placeholders: the stores hash and keep this form, so that a fork
    (another ``repository.url``, links rewritten by ``refresh_notebooks.py``) needs no new translation."""
    for real, placeholder in _site_urls():
        text = text.replace(real, placeholder)
    return text


def denormalize(text: str) -> str:
    for real, placeholder in _site_urls():
        text = text.replace(placeholder, real)
    return text


@dataclasses.dataclass(frozen=True)
class Unit:
    """One translatable piece of English text of a page."""

    key: str  # a notebook cell's id, or b<index> for a block of a markdown page
    index: int  # the cell's index in the notebook, or the block's index in the page
    text: str


@dataclasses.dataclass(frozen=True)
class Problem:
    """A unit of English text without a current translation."""

    page: str  # path of the English source, relative to ROOT
    unit: Unit
    kind: str  # "missing" or "stale"
    old_english: str | None = None  # what the stored translation translates, for a stale one
    old_chinese: str | None = None  # the stored translation, for a stale one

    def __str__(self) -> str:
        where = f"cell {self.unit.index} (id {self.unit.key})" if self.unit.key[:1] != "b" or self.page.endswith(
            ".ipynb") else f"block {self.unit.index}"
        if self.page == SITE_STORE.name:
            where = f"site string {self.unit.key!r}"
        first = next((line for line in self.unit.text.splitlines() if line.strip()), "")[:70]
        return f"{self.page}: {where}: {self.kind} translation: {first!r}"


# --- the English units -------------------------------------------------------------------------------------------

def english_pages() -> list[pathlib.Path]:
    """The source of every page of the English book, in reading order."""
    return book_tools.toc_sources()


def read_notebook(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def md_blocks(text: str) -> list[tuple[str, str]]:
    """A markdown page split into blocks at blank lines, a fenced block (``` or :::) kept whole,
    a table split into its rows (:func:`_table_rows`).

    Returns (block, separator) pairs: the separator is the exact text between a block and the next
    (newlines), so that joining ``block + separator`` gives the page back byte for byte.
    """
    pieces: list[tuple[str, str]] = []
    current: list[str] = []
    blanks = 0
    fence = None
    lines = text.split("\n")
    for number, line in enumerate(lines):
        stripped = line.strip()
        if fence is None and stripped == "":
            blanks += 1
            continue
        if blanks and current:
            pieces.append(("\n".join(current), "\n" * (blanks + 1)))
            current = []
        elif blanks and not current:
            pieces.append(("", "\n" * blanks))
        blanks = 0
        current.append(line)
        if fence is None:
            match = re.match(r"(`{3,}|:{3,})", stripped)
            if match:
                fence = match.group(1)
        elif set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            fence = None
    if current:
        pieces.append(("\n".join(current), "\n" * blanks))
    elif blanks:
        pieces.append(("", "\n" * blanks))
    return [row for block in pieces for row in _table_rows(*block)]


def _table_rows(block: str, separator: str) -> list[tuple[str, str]]:
    """A markdown table as one piece per row (its header and rule together), else the block itself.

    Each row is translated on its own: a new row (a new cause in the API page's causes table)
    is one new unit, and the other rows' translations stay current.
    """
    lines = block.split("\n")
    if len(lines) < 3 or not all(line.startswith("|") for line in lines) or not re.fullmatch(r"\|[-:| ]+\|", lines[1]):
        return [(block, separator)]
    rows = ["\n".join(lines[:2]), *lines[2:]]
    return [(row, "\n") for row in rows[:-1]] + [(rows[-1], separator)]


def join_md_blocks(pieces: list[tuple[str, str]]) -> str:
    return "".join(block + separator for block, separator in pieces)


def units_of(page: pathlib.Path) -> list[Unit]:
    """The translatable units of an English page."""
    if page.suffix == ".ipynb":
        nb = read_notebook(page)
        return [
            Unit(cell["id"], i, "".join(cell["source"]))
            for i, cell in enumerate(nb["cells"]) if cell["cell_type"] == "markdown"
        ]
    text = page.read_text(encoding="utf-8")
    return [Unit(f"b{i}", i, block) for i, (block, _) in enumerate(md_blocks(text)) if block.strip()]


def site_units() -> list[Unit]:
    """The book's own strings outside its pages: title, footer, the part captions of _toc.yml."""
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    units = [Unit("title", 0, config["title"]), Unit("footer", 1, (config.get("html") or {}).get("extra_footer", ""))]
    for i, part in enumerate(toc.get("parts", [])):
        units.append(Unit(f"caption{i}", 2 + i, part["caption"]))
    return units


# --- the stores -----------------------------------------------------------------------------------------------

def rel(path: pathlib.Path) -> str:
    path = path.resolve()
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)


def store_path(page: pathlib.Path) -> pathlib.Path:
    return page.with_name(page.stem + STORE_SUFFIX)


def load_store(path: pathlib.Path) -> dict:
    if not path.exists():
        return {"units": {}}
    return json.loads(path.read_text(encoding="utf-8"))


def save_store(path: pathlib.Path, source: str, entries: dict) -> None:
    data = {
        "source": source,
        "about": "Chinese translations of the units of `source`, keyed by cell id (notebook) or block index "
                 "(markdown page); en_sha256 is the hash of the English text translated. "
                 "Written by scripts/translate_book.py --import.",
        "units": entries,
    }
    path.write_text(json.dumps(data, ensure_ascii=False, indent=1, sort_keys=False) + "\n", encoding="utf-8")


def lookup(entries: dict, unit: Unit) -> tuple[str | None, Problem | None, str]:
    """The translation of ``unit``, or the problem; the third value is the page name for the problem."""
    digest = sha256(normalize(unit.text))
    entry = entries.get(unit.key)
    if entry is not None and entry["en_sha256"] == digest:
        return denormalize(entry["zh"]), None, ""
    for other in entries.values():
        if other["en_sha256"] == digest:
            return denormalize(other["zh"]), None, ""
    if entry is None:
        return None, ("missing",), ""
    return None, ("stale", denormalize(entry.get("en", "")), denormalize(entry["zh"])), ""


def translations(page: pathlib.Path | None) -> tuple[dict[str, str], list[Problem]]:
    """Every unit key of ``page`` (None: the site strings) mapped to its translation, and the problems."""
    units = site_units() if page is None else units_of(page)
    store = load_store(SITE_STORE if page is None else store_path(page))
    name = SITE_STORE.name if page is None else rel(page)
    found, problems = {}, []
    for unit in units:
        zh, problem, _ = lookup(store["units"], unit)
        if problem is None:
            found[unit.key] = zh
        else:
            problems.append(Problem(name, unit, *problem))
    return found, problems


def all_problems() -> list[Problem]:
    problems = translations(None)[1]
    for page in english_pages():
        problems.extend(translations(page)[1])
    return problems


# --- the Chinese tree ------------------------------------------------------------------------------------------

class Untranslated(Exception):
    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def zh_path(page: pathlib.Path) -> pathlib.Path:
    """Where the Chinese twin of an English source (a path under ROOT) is written."""
    return ZH / page.resolve().relative_to(ROOT)


def english_path(zh_page: pathlib.Path) -> pathlib.Path:
    return ROOT / zh_page.resolve().relative_to(ZH)


# --- the glossary: the English term at its first use on every page ---------------------------------------------

#: Glossary terms not annotated automatically: too common to repeat on every page (the intro and the first
#: chapter give their English), or also ordinary words (损失 "to lose", 指数 "exponential").
NOT_ANNOTATED = {"梯度", "损失", "损失函数", "初始化", "学习率", "复现", "指数", "ulp"}

_PROTECTED = re.compile(
    r"(?s:^```.*?^```[^\n]*$)"  # fenced code, across lines
    r"|(?s:\$\$.*?\$\$)|\$[^$]+?\$"  # math
    r"|\{[\w:-]+\}`[^`]*`|`[^`]*`"  # roles, inline code
    r"|\[[^\]]*\]\([^)]*\)|<[^>]+>"  # links, HTML tags
    r"|^#.*$|^:{3,}.*$|^`{3,}.*$|^:\w+:.*$",  # headings, directive lines and options: one line each
    re.M,
)


def glossary_terms() -> list[tuple[str, str]]:
    """(Chinese term, English term) pairs of the glossary that each page annotates at its first use, longest first."""
    pairs = []
    for line in GLOSSARY_SOURCE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or not re.search(r"[\u4e00-\u9fff]", cells[0]) or cells[0] == "中文" or "`" in cells[0]:
            continue
        variants = [v.strip() for v in re.sub(r"（.*?）", "", cells[0]).split("、") if v.strip()]
        english = [e.strip() for e in re.sub(r"\(.*?\)", "", cells[1]).split(",") if e.strip()]
        for i, variant in enumerate(variants):
            if variant not in NOT_ANNOTATED:
                pairs.append((variant, english[i] if len(english) == len(variants) else english[0]))
    return sorted(pairs, key=lambda pair: -len(pair[0]))


def _without_glosses(text: str, terms: list[tuple[str, str]]) -> str:
    """``text`` without the English that a translation wrote after a glossary term by hand ("上溢（overflow）",
    "上溢（overflow，...）"): the page gets it once, at the term's first use (``annotate_first_uses``)."""
    for zh, en in terms:
        gloss = r"\s+".join(re.escape(word) for word in en.split())
        text = re.sub(f"({re.escape(zh)})\\s*[（(]{gloss}s?[）)]", r"\1", text, flags=re.I)
        text = re.sub(f"({re.escape(zh)})\\s*（{gloss}s?[，,]\\s*", r"\1（", text, flags=re.I)
    return text


def annotate_first_uses(texts: list[str], terms: list[tuple[str, str]] | None = None) -> list[str]:
    """The texts of one page, in reading order, with "（English）" after the first use of each glossary term in
    running text (not in headings, code, math, links or directives), and nowhere else: the English a translation
    gives by hand after a term is dropped first. A term followed by a parenthesis gets its English inside it
    ("裁剪（`clipnorm`）" becomes "裁剪（gradient clipping，`clipnorm`）"), never a second pair."""
    terms = glossary_terms() if terms is None else terms
    pattern = re.compile("|".join(re.escape(zh) for zh, _ in terms)) if terms else None
    english = dict(terms)
    seen: set[str] = set()
    out = []
    for text in texts:
        if pattern is None:
            out.append(text)
            continue
        text = _without_glosses(text, terms)
        protected = [m.span() for m in _PROTECTED.finditer(text)]
        pieces, last = [], 0
        for match in pattern.finditer(text):
            term, start, end = match.group(0), match.start(), match.end()
            if term in seen or any(a <= start < b for a, b in protected):
                continue
            seen.add(term)
            after = text[end:end + 1]
            opening = re.match(r"\s*[（(]", text[end:])
            if opening:
                # a parenthesis after the term (on the next line, maybe): its English goes first inside it
                pieces.append(text[last:end + opening.end()] + f"{english[term]}，")
                last = end + opening.end()
                continue
            # inside parentheses already: "（全局范数裁剪）" becomes "（全局范数裁剪，global-norm clipping）"
            note = f"，{english[term]}" if after == "）" else f"（{english[term]}）"
            pieces.append(text[last:end] + note)
            last = end
        out.append("".join(pieces) + text[last:])
    return out


#: CJK characters and the full-width punctuation written between them.
_CJK_CHAR = r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef“”‘’…—]"
_CJK_BREAK = re.compile(f"(?<={_CJK_CHAR})[ \\t]*\\n[ \\t]*(?={_CJK_CHAR})")


_SECTION_LINK = re.compile(r"\[(?P<label>[^\]`*_\[]+)\]\((?P<page>(?![a-z]+:)[^)\s#]+)\.(?:ipynb|md)#(?P<anchor>[\w-]+)\)")


def html_section_links(text: str) -> str:
    """``text`` with each markdown link to a section of another page (``[label](../x/y.ipynb#section)``, the
    English heading's id) written as an HTML link to that page's HTML (``<a href="../x/y.html#section">``).

    The Chinese pages have the English sections' ids as anchors before their headings
    (``with_english_anchors``), so the link lands where the English one does; but MyST checks a markdown
    link's ``#section`` against the slugs of the target page's headings, which are Chinese there, and would
    warn (the build runs with ``-W``). An HTML link is not checked, and goes to the same place."""
    return _SECTION_LINK.sub(lambda m: f'<a href="{m["page"]}.html#{m["anchor"]}">{m["label"]}</a>', text)


def join_cjk_lines(text: str) -> str:
    """``text`` with every line break between two Chinese characters (or full-width punctuation) removed, outside
    fenced code and display math: a browser renders such a break as a space, which Chinese text does not have.
    The stores keep the translations wrapped as they were written; the Chinese pages get them joined."""
    fences = [m.span() for m in re.finditer(r"(?s:^(```|:::).*?^\1[^\n]*$)|(?s:\$\$.*?\$\$)", text, re.M)]
    pieces, last = [], 0
    for match in _CJK_BREAK.finditer(text):
        if any(a <= match.start() < b for a, b in fences):
            continue
        pieces.append(text[last:match.start()])
        last = match.end()
    return "".join(pieces) + text[last:]


#: The labels of the toggles of hidden code cells (myst-nb's cell-level ``code_prompt_show``/``code_prompt_hide``,
#: set by scripts/hide_solutions.py): prose in a code cell's metadata, the one part of a code cell translated.
PROMPTS = [
    (re.compile(r"^Solution to exercise (\d+): show the code and its output$"), r"练习 \1 的解答：显示代码及其输出"),
    (re.compile(r"^Solution to exercise (\d+): hide$"), r"练习 \1 的解答：隐藏"),
    (re.compile(r"^Solution: show the code and its output$"), "解答：显示代码及其输出"),
    (re.compile(r"^Solution: hide$"), "解答：隐藏"),
]
PROMPT_KEYS = ("code_prompt_show", "code_prompt_hide")
#: myst-nb's own toggle labels ("Show code cell source"), for the Chinese build.
ZH_NB_PROMPTS = {"nb_code_prompt_show": "显示代码单元", "nb_code_prompt_hide": "隐藏代码单元"}


def _translated_prompt(text: str) -> str:
    for pattern, replacement in PROMPTS:
        if pattern.match(text):
            return pattern.sub(replacement, text)
    return text


def _section_id(heading_line: str) -> str:
    """The HTML id docutils gives the section of a markdown heading (its text without the markup, as make_id)."""
    from docutils.nodes import make_id

    text = heading_line.lstrip("#").strip()
    text = re.sub(r"\{[\w:-]+\}`([^`]*)`", r"\1", text)
    text = re.sub(r"`([^`]*)`", r"\1", text)
    text = re.sub(r"\$([^$]*)\$", r"\1", text)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.replace("*", "")
    return make_id(text)


def _headings(text: str) -> list[re.Match]:
    fences = [m.span() for m in re.finditer(r"^```.*?^```[^\n]*$", text, re.S | re.M)]
    return [h for h in _HEADING_LINE.finditer(text) if not any(a <= h.start() < b for a, b in fences)]


def with_english_anchors(english: str, chinese: str) -> str:
    """``chinese`` with, before each heading, an anchor that has the id of the English heading's section: a link
    to ``page#english-section`` (the API page's table of causes, say) lands on the same section in both editions.
    Headings are paired in order; a unit whose headings do not pair up gets no anchors."""
    en_headings, zh_headings = _headings(english), _headings(chinese)
    if len(en_headings) != len(zh_headings):
        return chinese
    for en, zh in reversed(list(zip(en_headings, zh_headings))):
        section = _section_id(en.group(0))
        if section and not en.group(0).startswith("# ") and section != _section_id(zh.group(0)):
            chinese = chinese[:zh.start()] + f'<a id="{section}"></a>\n\n' + chinese[zh.start():]
    return chinese


def chinese_notebook_text(page: pathlib.Path, found: dict[str, str]) -> str:
    import nbformat

    nb = read_notebook(page)
    zh = copy.deepcopy(nb)
    for cell in zh["cells"]:
        mystnb = cell.get("metadata", {}).get("mystnb", {})
        for key in PROMPT_KEYS:
            if isinstance(mystnb.get(key), str):
                mystnb[key] = _translated_prompt(mystnb[key])
    markdown = [cell for cell in zh["cells"] if cell["cell_type"] == "markdown"]
    for cell, text in zip(markdown, annotate_first_uses([found[cell["id"]] for cell in markdown])):
        text = html_section_links(join_cjk_lines(with_english_anchors("".join(cell["source"]), text)))
        cell["source"] = text.splitlines(keepends=True)
    return nbformat.writes(nbformat.from_dict(zh)) + "\n"


def chinese_page_text(page: pathlib.Path, found: dict[str, str]) -> str:
    pieces = md_blocks(page.read_text(encoding="utf-8"))
    keys = [i for i, (block, _) in enumerate(pieces) if block.strip() and f"b{i}" in found]
    annotated = dict(zip(keys, annotate_first_uses([found[f"b{i}"] for i in keys])))
    annotated = {i: html_section_links(join_cjk_lines(with_english_anchors(pieces[i][0], text)))
                 for i, text in annotated.items()}
    return join_md_blocks([(annotated.get(i, block), separator) for i, (block, separator) in enumerate(pieces)])


def _yaml_dump(data) -> str:
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    def text(dumper, value):
        style = "|" if "\n" in value else None
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)

    Dumper.add_representer(str, text)
    return yaml.dump(data, Dumper=Dumper, allow_unicode=True, sort_keys=False, width=100)


def _relative_to_zh(value: str) -> str:
    return os.path.relpath(ROOT / value, ZH).replace(os.sep, "/")


def chinese_config_text(site: dict[str, str]) -> str:
    import yaml

    config = yaml.safe_load((ROOT / "_config.yml").read_text())
    config["title"] = site["title"]
    config["exclude_patterns"] = ["_build", "**/.ipynb_checkpoints"]
    repo = config.setdefault("repository", {})
    repo["path_to_book"] = "/".join(p for p in ((repo.get("path_to_book") or "").strip("/"), "zh") if p)
    html = config.setdefault("html", {})
    if html.get("baseurl"):
        html["baseurl"] = html["baseurl"].rstrip("/") + "/zh/"
    if site.get("footer"):
        html["extra_footer"] = site["footer"]
    sphinx = config.setdefault("sphinx", {})
    extensions = sphinx.get("local_extensions") or {}
    sphinx["local_extensions"] = {name: _relative_to_zh(path) for name, path in extensions.items()}
    cfg = sphinx.setdefault("config", {})
    cfg["language"] = "zh_CN"
    cfg.update(ZH_NB_PROMPTS)
    for key in ("html_static_path", "templates_path", "html_extra_path"):
        if key in cfg:
            cfg[key] = [_relative_to_zh(p) for p in cfg[key]]
    for key in ("html_logo", "html_favicon"):
        if cfg.get(key) and "://" not in cfg[key]:
            cfg[key] = _relative_to_zh(cfg[key])
    if cfg.get("ogp_site_url"):
        cfg["ogp_site_url"] = cfg["ogp_site_url"].rstrip("/") + "/zh/"
    if "ogp_site_name" in cfg:
        cfg["ogp_site_name"] = site["title"]
    if (cfg.get("ogp_social_cards") or {}).get("enable"):
        # The cards are drawn with matplotlib's fonts, which have no Chinese glyphs: no cards for zh.
        cfg["ogp_social_cards"] = {**cfg["ogp_social_cards"], "enable": False}
    header = (
        "# GENERATED by scripts/translate_book.py from _config.yml: do not edit (edit _config.yml, or the\n"
        "# translations in _site.zh.json, and run the script). The Chinese edition is built into\n"
        "# _build/html/zh/ by the English build (scripts/zh_edition.py).\n"
    )
    return header + _yaml_dump(config)


def chinese_toc_text(site: dict[str, str]) -> str:
    import yaml

    toc = yaml.safe_load((ROOT / "_toc.yml").read_text())
    for i, part in enumerate(toc.get("parts", [])):
        part["caption"] = site[f"caption{i}"]
    if toc.get("parts"):
        toc["parts"][-1].setdefault("chapters", []).append({"file": GLOSSARY_DOC})
    header = "# GENERATED by scripts/translate_book.py from _toc.yml (captions from _site.zh.json): do not edit.\n"
    return header + _yaml_dump(toc)


def chinese_tree(draft: bool = False) -> dict[pathlib.Path, bytes]:
    """Every file of zh/, as this script writes it.

    Args:
        draft: put the old translation where one is stale and the English text where one is missing, instead
            of failing (to try a build while translating; ``--check`` and the tests fail on a draft).

    Raises:
        Untranslated: naming every unit without a current translation.
    """
    files: dict[pathlib.Path, bytes] = {}
    site, problems = translations(None)
    if draft:
        site.update({p.unit.key: p.old_chinese or p.unit.text for p in problems})
        problems = []
    for page in english_pages():
        found, page_problems = translations(page)
        if draft:
            found.update({p.unit.key: p.old_chinese or p.unit.text for p in page_problems})
            page_problems = []
        problems.extend(page_problems)
        if page_problems:
            continue
        if page.suffix == ".ipynb":
            text = chinese_notebook_text(page, found)
        else:
            text = chinese_page_text(page, found)
        files[zh_path(page)] = text.encode("utf-8")
    if problems:
        raise Untranslated(problems)
    files[ZH / "_config.yml"] = chinese_config_text(site).encode("utf-8")
    files[ZH / "_toc.yml"] = chinese_toc_text(site).encode("utf-8")
    files[ZH / (GLOSSARY_DOC + ".md")] = join_cjk_lines(GLOSSARY_SOURCE.read_text(encoding="utf-8")).encode("utf-8")
    for name in COPIED:
        files[ZH / name] = (ROOT / name).read_bytes()
    return files


def generated_files_on_disk() -> set[pathlib.Path]:
    return {
        p for p in ZH.rglob("*")
        if p.is_file() and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts
    }


def differences() -> list[str]:
    """The files of zh/ that differ from what this script writes (Untranslated if it cannot write them)."""
    files = chinese_tree()
    out = []
    for path, data in sorted(files.items()):
        if not path.exists():
            out.append(f"{rel(path)}: missing")
        elif path.read_bytes() != data:
            out.append(f"{rel(path)}: differs from what scripts/translate_book.py writes")
    for path in sorted(generated_files_on_disk() - set(files)):
        out.append(f"{rel(path)}: not written by scripts/translate_book.py (left over?)")
    return out


def write_tree(draft: bool = False) -> list[pathlib.Path]:
    files = chinese_tree(draft)
    written = []
    for path, data in files.items():
        if not path.exists() or path.read_bytes() != data:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
            written.append(path)
    for path in generated_files_on_disk() - set(files):
        path.unlink()
        written.append(path)
    return written


# --- export / import of units for translating -------------------------------------------------------------------

def _page_arg(name: str) -> pathlib.Path | None:
    if name in ("site", SITE_STORE.name):
        return None
    path = (ROOT / name).resolve() if not pathlib.Path(name).is_absolute() else pathlib.Path(name)
    if path not in [p.resolve() for p in english_pages()]:
        raise SystemExit(f"{name}: not a page of _toc.yml (or 'site')")
    return path


def export_units(page: pathlib.Path | None, only_problems: bool) -> str:
    units = site_units() if page is None else units_of(page)
    problems = {p.unit.key for p in translations(page)[1]}
    parts = []
    for unit in units:
        if only_problems and unit.key not in problems:
            continue
        parts.append(f"{MARKER}{unit.key}\n{unit.text}\n")
    return "".join(parts)


def parse_units(text: str) -> dict[str, str]:
    out, key, lines = {}, None, []
    for line in text.split("\n"):
        if line.startswith(MARKER):
            if key is not None:
                out[key] = "\n".join(lines).rstrip("\n")
            key, lines = line[len(MARKER):].strip(), []
        elif key is not None:
            lines.append(line)
    if key is not None:
        out[key] = "\n".join(lines).rstrip("\n")
    return out


def import_units(page: pathlib.Path | None, text: str) -> int:
    units = {u.key: u for u in (site_units() if page is None else units_of(page))}
    path = SITE_STORE if page is None else store_path(page)
    store = load_store(path)
    entries = store["units"]
    new = parse_units(text)
    unknown = sorted(set(new) - set(units))
    if unknown:
        raise SystemExit(f"{path.name}: no English unit with the keys {unknown}")
    for key, zh in new.items():
        if zh.strip() == SAME:
            zh = units[key].text
        if page is not None and page.suffix == ".md" and units[key].text.strip() and not zh.strip():
            raise SystemExit(f"{path.name}: empty translation for {key}")
        en = normalize(units[key].text)
        entries[key] = {"en_sha256": sha256(en), "en": en, "zh": normalize(zh)}
    ordered = {k: entries[k] for k in units if k in entries}
    ordered.update({k: v for k, v in entries.items() if k not in ordered})  # kept: an old cell may come back
    save_store(path, SITE_STORE.name if page is None else rel(page), ordered)
    return len(new)


def prune_stores() -> None:
    """Drop stored entries whose key no longer exists and whose hash matches no current unit."""
    for page in [None, *english_pages()]:
        units = site_units() if page is None else units_of(page)
        path = SITE_STORE if page is None else store_path(page)
        if not path.exists():
            continue
        store = load_store(path)
        keys, hashes = {u.key for u in units}, {sha256(normalize(u.text)) for u in units}
        kept = {k: v for k, v in store["units"].items() if k in keys or v["en_sha256"] in hashes}
        if kept != store["units"]:
            save_store(path, store.get("source", path.name), kept)


def refresh_rewrapped() -> list[str]:
    """Keep the translations of units whose English changed only in line breaks and spaces (text re-wrapped):
    their hash and stored English are updated, the Chinese is kept. Returns the units refreshed."""
    refreshed = []
    for page in [None, *english_pages()]:
        problems = [p for p in translations(page)[1] if p.kind == "stale"]
        if not problems:
            continue
        path = SITE_STORE if page is None else store_path(page)
        store = load_store(path)
        for problem in problems:
            if " ".join(problem.old_english.split()) == " ".join(problem.unit.text.split()):
                en = normalize(problem.unit.text)
                store["units"][problem.unit.key].update({"en_sha256": sha256(en), "en": en})
                refreshed.append(str(problem))
        save_store(path, store.get("source", path.name), store["units"])
    return refreshed


_LABEL = re.compile(r"^\([\w-]+\)=[ \t]*\n", re.M)
_HEADING_LINE = re.compile(r"^#{1,6} .*$", re.M)
_ADMONITION_WRAP = re.compile(
    r"^(?P<fence>`{3,}|:{3,})\{(?:admonition|dropdown)\}[ \t]*(?P<title>[^\n]*)\n"
    r"(?P<options>(?::[\w-]+:[^\n]*\n)*)(?P<body>.*?)\n(?P=fence)[ \t]*$",
    re.S | re.M,
)
_DETAILS_WRAP = re.compile(r'<details class="solution">\s*<summary>(?P<title>.*?)</summary>\s*(?P<body>.*?)\s*</details>',
                           re.S)


def _as_details(text: str) -> str:
    """``text`` with each admonition/dropdown wrapper written as the book's hidden solution (``<details>``)."""
    def wrap(match):
        return (f'<details class="solution">\n<summary>{match.group("title").strip()}</summary>\n\n'
                f'{match.group("body").strip()}\n\n</details>')
    return _ADMONITION_WRAP.sub(wrap, text)


def _carry_structure(old_en: str, new_en: str, old_zh: str) -> str | None:
    """The translation of ``new_en`` when it differs from ``old_en`` only by structure the translation can take
    over as it is: MyST labels ``(name)=`` before headings, and solution wrappers (admonition -> ``<details>``).
    None if anything else changed."""
    def flat(text):
        return " ".join(text.split())

    bare_new = _LABEL.sub("", new_en)
    zh = old_zh
    if flat(_as_details(old_en)) == flat(_as_details(bare_new)) and _as_details(old_en) != old_en or (
            "<details" in bare_new and flat(_as_details(old_en)) == flat(bare_new)):
        zh = _as_details(zh)
    elif flat(old_en) != flat(bare_new):
        return None
    # labels: before the k-th heading of the English, before the k-th heading of the Chinese
    en_headings = list(_HEADING_LINE.finditer(bare_new))
    zh_headings = list(_HEADING_LINE.finditer(zh))
    if len(en_headings) != len(zh_headings):
        return None
    inserts = []
    for label in _LABEL.finditer(new_en):
        after = _HEADING_LINE.search(new_en, label.end())
        if after is None or after.start() != label.end():
            return None
        k = sum(1 for h in _HEADING_LINE.finditer(new_en) if h.start() < after.start())
        inserts.append((zh_headings[k].start(), label.group(0)))
    for position, label in sorted(inserts, reverse=True):
        if zh[position - len(label):position] != label:
            zh = zh[:position] + label + zh[position:]
    return zh


def carry_structure() -> list[str]:
    """Bring stale translations up to date where the English changed only in labels or solution wrappers."""
    carried = []
    for page in [None, *english_pages()]:
        problems = [p for p in translations(page)[1] if p.kind == "stale"]
        if not problems:
            continue
        path = SITE_STORE if page is None else store_path(page)
        store = load_store(path)
        for problem in problems:
            zh = _carry_structure(problem.old_english, problem.unit.text, problem.old_chinese)
            if zh is not None:
                en = normalize(problem.unit.text)
                store["units"][problem.unit.key] = {"en_sha256": sha256(en), "en": en, "zh": normalize(zh)}
                carried.append(str(problem))
        save_store(path, store.get("source", path.name), store["units"])
    return carried


def stale_report() -> str:
    lines = []
    for problem in all_problems():
        lines.append(str(problem))
        if problem.old_english is not None:
            diff = difflib.unified_diff(problem.old_english.splitlines(), problem.unit.text.splitlines(),
                                        "translated English", "current English", lineterm="", n=1)
            lines.extend("    " + line for line in diff)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--check", action="store_true", help="write nothing; fail if zh/ is out of date")
    group.add_argument("--stale", action="store_true", help="list missing and stale translations, with diffs")
    group.add_argument("--export", metavar="PAGE", help="print the English units of PAGE (or 'site')")
    group.add_argument("--import", dest="import_", metavar="PAGE", help="store the translations read from stdin")
    group.add_argument("--prune", action="store_true", help="drop stored translations of units that are gone")
    group.add_argument("--rewrapped", action="store_true",
                       help="keep the translations of units whose English was only re-wrapped, or changed "
                            "only in MyST labels or solution wrappers (carried over into the Chinese)")
    parser.add_argument("--draft", action="store_true",
                        help="write zh/ even with stale (old translation kept) or missing (English) units")
    parser.add_argument("--todo", action="store_true", help="with --export: only the missing and stale units")
    args = parser.parse_args(argv)
    if args.export:
        sys.stdout.write(export_units(_page_arg(args.export), args.todo))
        return 0
    if args.import_:
        count = import_units(_page_arg(args.import_), sys.stdin.read())
        print(f"stored {count} translations for {args.import_}")
        return 0
    if args.prune:
        prune_stores()
        return 0
    if args.rewrapped:
        for line in refresh_rewrapped():
            print("kept (only re-wrapped):", line)
        for line in carry_structure():
            print("kept (labels or solution wrappers carried over):", line)
        return 0
    if args.stale:
        report = stale_report()
        print(report or "every unit of English text has a current translation")
        return 1 if report else 0
    try:
        if args.check:
            diffs = differences()
            print("\n".join(diffs) or "zh/ is up to date")
            return 1 if diffs else 0
        written = write_tree(args.draft)
    except Untranslated as error:
        print(f"{len(error.problems)} units of English text have no current translation "
              "(see `python scripts/translate_book.py --stale`):", file=sys.stderr)
        print(str(error), file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {rel(path)}" if path.exists() else f"removed {rel(path)}")
    if args.draft:
        problems = all_problems()
        if problems:
            print(f"a DRAFT: {len(problems)} units are stale (old translation kept) or missing (English kept); "
                  "see --stale", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
