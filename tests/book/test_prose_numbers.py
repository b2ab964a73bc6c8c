"""Every number a page's prose states, and every verdict it gives, is one the reader can check on the page.

The class of error this catches: a sentence that states a measured value or a verdict which the page's
own outputs, the shipped benchmark results, or its cited source no longer say (a ratio re-measured while
its sentence stayed behind, a "met" beside a table that says "not resolved", a count from an older run).
It reads committed outputs only (no notebook is executed), in both editions: every markdown cell of the
notebooks and every block of the markdown pages of ``_toc.yml``, and the Chinese translation of each.

**A number the prose states** is a run of digits in the prose, with its decimals (``1.13``), its thousands
separators (``2,100,225``) or an exponent (``1e-7``), that is not:

- a whole number below 10 without a unit after it (``two layers`` and ``2 layers`` say the same, and
  neither is measured; ``3 ms``, ``8 %``, ``4 times``, ``5 M``, ``2 倍`` are checked);
- inside inline code, a fenced block, math (``$...$``, ``$$...$$``), an HTML tag, a link's target or a
  role's target (what ``_prose`` of ``test_translations`` removes), or part of a word or identifier
  (``float32``, ``H100``, ``AVX-512``, ``log1p``, ``10¹¹``);
- a year (1900 to 2099), a heading's numbering, a list's numbering (``1.`` at a line's start), a reference
  marker (``[1]``), an issue number (``#117319``);
- an index: the numbers that follow *section, exercise, chapter, cell, case, part, item, point, issue, row,
  question, answer, line, figure, table, version* (or their plurals; ``cells 6, 9 and 12`` is one index
  list), or *Python, Keras, TensorFlow, TF* (a version);
- a term of a formula written in plain text: a number next to ``/``, ``^``, ``*``, ``+``, ``=``, ``<``,
  ``>``, ``−`` (``1/(1−e^(−x))`` defines a function, it measures nothing).

**Where it may come from.** Each such number must be, in the sentence's own page (a sentence ends at
``.``, ``!``, ``?`` before a capital, at ``。！？``, at a paragraph or a list item):

1. printed by a cell: a number in a committed output of the page (stream, plain text, HTML without its
   tags), or written in the page's code (a setting the code shows: ``batch_size=64``); a decimal of the
   prose may be an output's value rounded to the prose's places (``1.1`` for a printed ``1.13``; a whole
   number is exact), and a number with ``%`` a printed fraction times 100;
2. read from the shipped results (``companion/book/benchmark_results/*.json``), on a page whose code
   loads them (``load_results``): any numeric value of a result, as the page may write it (rounded to the
   prose's places, as a percentage ``100 v`` or ``100 (v − 1)`` with ``%``, a count of weights in
   millions with ``M``), or a number in a result row's label;
3. a citation (the convention of CONTRIBUTING.md, *Numbers in prose*): a sentence that cites its source
   states that source's numbers. The source is a link to a page outside the book (``[text](https://…)``),
   a numbered reference defined on the page (``[1]``), an issue (``owner/repo#123``, ``tensorflow#117319``)
   or a ``{cite}`` role, in the same sentence; these are trusted as cited. Two sources are checked, and
   count for their whole paragraph (or list item): a ``{doc}`` link (or a markdown link) to another page
   of the book, whose numbers by rules 1 and 2 the paragraph may state, and a repository file named in
   inline code (``benchmarks/scale.py``, ``companion/training/spikes.py``: the number must be in that file,
   as a literal; with ``%``, times 100).

**A verdict** is *not resolved* (无法判定), or *met* / *missed* in italics or in a sentence about a
target (达到 / 未达到 next to 目标: 目标已达到, 未达到目标); a Chinese term right after the English verdict
it translates (``*met*，达到``) is that same verdict. A verdict in quotation marks (``"not resolved"``,
“无法判定”) names the word, and one after *whether* (是否) asks it: neither is given, and both are left
alone. Each verdict must agree with the shipped results: among the numbers of its stretch of the
sentence (from the verdict before it to the verdict after it), one is the median (``ratio``) of a
shipped result's row, as the page writes it, whose ``verdict`` is that word.

The Chinese units follow the same rules (their citations are the English's markup, which a translation
keeps); numbers that only the Chinese states are checked as well.
"""

from __future__ import annotations

import functools
import html
import json
import math
import pathlib
import re

import pytest

import book_tools
from book_tools.zh import store, units
from companion.book.benchmark_results import load_results
from test_translations import _prose

PAGES = units.english_pages()
ROOT = book_tools.ROOT

#: A number as prose writes it; what is next to it decides whether it is one (module docstring).
NUMBER = re.compile(r"(?<![\w.#/^*+=<>−\-])(\d{1,3}(?:,\d{3})+|\d+)(\.\d+)?([eE][-+−]?\d+)?(?![\w/^*+=<>−]|\.\d|,\d{3})")
_INDEX_WORDS = (r"sections?|exercises?|chapters?|cells?|cases?|parts?|items?|points?|issues?|rows?|questions?|"
                r"answers?|lines?|figures?|tables?|versions?|Python|Keras|TensorFlow|TF|练习|第")
_INDEX = re.compile(rf"(?i)(?:\b|(?<=[\u4e00-\u9fff]))(?:{_INDEX_WORDS})\s*\d+(?:\.\d+)*"
                    rf"(?:\s*(?:,|、|and|or|to|–|-|和|或|至|到)\s*\d+(?:\.\d+)*)*")
_UNIT = re.compile(r"\s*(%|ms\b|µs\b|s\b|seconds?\b|minutes?\b|[KMG]i?B\b|bytes?\b|[KMGT]?FLOP|M\b|million|"
                   r"×|x\b|times\b|ulps?\b|倍|秒|毫秒|个 ulp)")
_FORMULA = re.compile(r"[/^*+=<>−]\s*$")
_FORMULA_AFTER = re.compile(r"^\s*[/^*+=<>−](?!\s*[A-Za-z]{3})")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z*_(“\"⟦])|(?<=[。！？])")

_EXTERNAL_LINK = re.compile(r"\[([^\]]*)\]\((?:https?:)[^)]*\)")
_PAGE_LINK = re.compile(r"\[([^\]]*)\]\(([^)#]+?)\.(?:ipynb|md)(?:#[^)]*)?\)")
_DOC_ROLE = re.compile(r"\{doc\}`(?:[^`<]*<)?([^`>]+)>?`")
_CITE_ROLE = re.compile(r"\{cite(?::\w+)?\}`[^`]*`")
_ISSUE = re.compile(r"\b[\w.-]+(?:/[\w.-]+)?#\d+")
_MARKER = re.compile(r"\[\d+\](?!\()")
_FILE = re.compile(r"`((?:benchmarks|companion|scripts|tests)/[\w/.-]+\.\w+)`")

VERDICTS = {"not resolved": "not resolved", "missed": "missed", "met": "met",
            "无法判定": "not resolved", "未达到": "missed", "达到": "met"}  # the longer term first
_VERDICT = re.compile(r"(?<![\w“\"'‘])(not resolved|missed|met)(?![\w”\"'’])|(无法判定|(?<=目标)\S{0,2}(?:未达到|达到)|"
                      r"(?:未达到|(?<!未)达到)了?(?=目标)(?!目标所需))")


@functools.cache
def _results():
    return load_results()


@functools.cache
def _result_values() -> tuple[float, ...]:
    """Every numeric value of every shipped result, and the numbers in its rows' labels."""
    values = []

    def walk(node):
        if isinstance(node, bool):
            return
        if isinstance(node, (int, float)):
            values.append(float(node))
        elif isinstance(node, dict):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)
        elif isinstance(node, str):
            values.extend(_float(m) for m in NUMBER.finditer(node))

    for result in _results():
        walk(result.document)
        walk([dict(row) for row in result.ratios])
    return tuple(v for v in values if math.isfinite(v))


def _float(match: re.Match) -> float:
    return float(match.group().replace(",", "").replace("−", "-"))


def _places(text: str) -> int:
    return len(text.split(".")[1].split("e")[0].split("E")[0]) if "." in text else 0


def _numbers(text: str) -> list[float]:
    return [_float(m) for m in NUMBER.finditer(text)]


def _output_text(cell: dict) -> str:
    parts = []
    for output in cell.get("outputs", []):
        if "text" in output:
            parts.append("".join(output["text"]))
        data = output.get("data", {})
        for kind in ("text/plain", "text/markdown", "text/latex"):
            if kind in data and "text/html" not in data:
                parts.append("".join(data[kind]))
        if "text/html" in data:
            parts.append(html.unescape(re.sub(r"<[^>]+>", " ", "".join(data["text/html"]))))
        if "text/markdown" in data and "text/html" in data:
            parts.append("".join(data["text/markdown"]))
    return "\n".join(parts)


@functools.cache
def _page_sources(path: pathlib.Path) -> tuple[tuple[float, ...], bool]:
    """The numbers a page's cells print or write, and whether its code reads the shipped results."""
    if path.suffix != ".ipynb":
        return (), False
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    code = [c for c in cells if c["cell_type"] == "code"]
    numbers = []
    for cell in code:
        numbers += _numbers(_output_text(cell))
        numbers += _numbers("".join(cell["source"]))
    return tuple(numbers), any("load_results" in "".join(c["source"]) for c in code)


def _resolve(page: pathlib.Path, target: str) -> pathlib.Path | None:
    base = ROOT if target.startswith("/") else page.parent
    for suffix in (".ipynb", ".md"):
        candidate = (base / (target.lstrip("/") + suffix)).resolve()
        if candidate.is_file():
            return candidate
    return None


def _matches(value: float, text: str, candidates) -> bool:
    places = _places(text)
    if not places:  # a whole number is stated exactly: rounding to units would let a table back any count
        return value in candidates
    return any(abs(round(candidate, places) - value) < 10 ** -(places + 3) for candidate in candidates)


def _from_results(value: float, text: str, after: str) -> bool:
    values = _result_values()
    if _matches(value, text, values):
        return True
    if re.match(r"\s*%", after):
        return any(abs(100 * v - value) <= 0.5 or abs(abs(100 * (v - 1)) - value) <= 0.5 for v in values)
    if re.match(r"\s*(M\b|million)", after):
        return any(abs(v / 1e6 - value) <= 0.5 * 10 ** -_places(text) for v in values)
    return False


def _supported(page: pathlib.Path, value: float, text: str, after: str, sentence: str, paragraph: str) -> bool:
    if "⟦cite⟧" in sentence:
        return True
    percent = bool(re.match(r"\s*%", after))
    pages = [page] + [p for p in (_resolve(page, t) for t in re.findall(r"⟦doc:([^⟧]+)⟧", paragraph)) if p]
    for source in pages:
        numbers, reads_results = _page_sources(source)
        if _matches(value, text, numbers) or percent and _matches(value, text, [100 * n for n in numbers]):
            return True
        if reads_results and _from_results(value, text, after):
            return True
    for name in re.findall(r"⟦file:([^⟧]+)⟧", paragraph):
        file = ROOT / name
        numbers = _numbers(file.read_text(encoding="utf-8")) if file.is_file() else []
        if _matches(value, text, numbers) or percent and _matches(value, text, [100 * n for n in numbers]):
            return True
    return False


def _marked(raw: str) -> str:
    """The markdown with its citations and cross-references as markers that survive ``_prose``."""
    text = re.sub(r"\$\$.*?\$\$|\$[^$]+?\$", " ", raw, flags=re.S)  # math, also inline math over two lines
    text = _CITE_ROLE.sub(" ⟦cite⟧ ", text)
    text = _DOC_ROLE.sub(lambda m: f" ⟦doc:{m.group(1)}⟧ ", text)
    text = _EXTERNAL_LINK.sub(lambda m: f"{m.group(1)} ⟦cite⟧", text)
    text = _PAGE_LINK.sub(lambda m: f"{m.group(1)} ⟦doc:{m.group(2)}⟧", text)
    text = _FILE.sub(lambda m: f" ⟦file:{m.group(1)}⟧ ", text)
    text = _MARKER.sub(" ⟦cite⟧ ", text)
    text = re.sub(r"^#+ .*$", lambda m: re.sub(r"^(#+\s*)[\d.]+", r"\1", m.group()), text, flags=re.M)
    return text


def _paragraphs(raw: str) -> list[list[str]]:
    """The prose's paragraphs (a list item is one), each as its sentences, citations and links marked."""
    prose = _ISSUE.sub(" ⟦cite⟧ ", _prose(_marked(raw)))
    paragraphs = re.split(r"\n\s*\n|\n\s*(?=[-*]\s|\d+\.\s|\|)", prose)
    return [[s for s in _SENTENCE_END.split(p) if s and s.strip()] for p in paragraphs if p.strip()]


def _stated(sentence: str):
    """The numbers a sentence states, as (match text, value, the text after it)."""
    text = re.sub(r"⟦[^⟧]*⟧", lambda m: " " * len(m.group()), sentence)
    text = _INDEX.sub(lambda m: " " * len(m.group()), text)
    text = re.sub(r"^\s*(\d+[.)]\s)", lambda m: " " * len(m.group()), text)
    for match in NUMBER.finditer(text):
        before, after = text[:match.start()], text[match.end():]
        value = _float(match)
        if match.group(2) is None and match.group(3) is None and (
                1900 <= value <= 2099 or (value < 10 and not _UNIT.match(after))):
            continue
        if _FORMULA.search(before) or _FORMULA_AFTER.match(after):
            continue
        yield match.group(), value, after


def _verdict_findings(sentence: str) -> list[str]:
    found = []
    # a Chinese term that translates the English verdict beside it is that verdict
    sentence = re.sub(r"([*“\"](?:met|missed|not resolved)[*”\"])[，,、]?\s*[（(]?(?:达到|未达到|无法判定)[）)]?", r"\1",
                      sentence)
    hits = []
    for hit in _VERDICT.finditer(sentence):
        before = sentence[:hit.start()].rstrip("*")
        if re.search(r"[“\"‘]$|\bwhether\b[^.;:]*$|(是否|无论是|还是)\S{0,6}$", before) or "是否" in hit.group():
            continue  # named, or asked: not given
        italic = sentence[hit.start() - 1:hit.start()] == "*"
        if hit.group(1) in ("met", "missed") and not italic and not re.search(r"\btargets?\b", sentence):
            continue  # the verb (a user "met" an error), not a verdict
        hits.append(hit)
    for index, hit in enumerate(hits):
        word = VERDICTS[hit.group(1) or next(term for term in VERDICTS if term in hit.group(2))]
        start = hits[index - 1].end() if index else 0
        end = hits[index + 1].start() if index + 1 < len(hits) else len(sentence)
        stretch = sentence[start:end]
        medians = [(_places(t), v) for t, v, _ in _stated(stretch)]
        verdicts = {row["verdict"] for result in _results() for row in result.ratios
                    for places, value in medians
                    if places and abs(round(row["ratio"], places) - value) < 10 ** -(places + 3)}
        if word not in verdicts:
            said = f"the rows whose median it states say {sorted(verdicts)}" if verdicts else (
                "no shipped result's median is stated beside it")
            found.append(f"verdict {hit.group()!r}: {said}")
    return found


def findings(page: pathlib.Path, raw: str) -> list[str]:
    """What a unit of prose (a markdown cell, a block, a translation) states that its page cannot back."""
    out = []
    for sentences in _paragraphs(raw):
        paragraph = " ".join(sentences)
        for sentence in sentences:
            shown = " ".join(re.sub(r"⟦[^⟧]*⟧", "", sentence).split())
            for text, value, after in _stated(sentence):
                if not _supported(page, value, text, after, sentence, paragraph):
                    out.append(f"{text!r} in {shown[:160]!r}")
            out += [f"{finding} in {shown[:160]!r}" for finding in _verdict_findings(sentence)]
    return out


def _name(path: pathlib.Path) -> str:
    return path.relative_to(ROOT).as_posix()


def page_findings(page: pathlib.Path) -> list[str]:
    """Every finding of a page's English units and of their Chinese translations, with the cell's index."""
    translated = store.translations(page)[0]
    out = []
    for unit in units.of(page):
        where = f"cell {unit.index}" if page.suffix == ".ipynb" else f"block {unit.index}"
        out += [f"{where} ({unit.key}): {f}" for f in findings(page, unit.text)]
        if unit.key in translated:
            out += [f"{where} ({unit.key}), Chinese: {f}" for f in findings(page, translated[unit.key])]
    return out


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_number_and_verdict_the_prose_states_is_backed(page):
    """The rule is this module's docstring; CONTRIBUTING.md (*Numbers in prose*) says how to cite."""
    found = page_findings(page)
    assert not found, (f"{_name(page)}: {len(found)} numbers or verdicts that no output of the page, shipped "
                       "result or cited source backs:\n" + "\n".join(found))


def test_the_check_catches_what_it_is_for():
    """The check itself: a stale ratio, an unsupported count and a wrong verdict are found; an output's value,
    a cited number, an index and a formula are not."""
    page = ROOT / "book" / "tools" / "performance.ipynb"
    row = next(row for result in _results() if result.benchmark != "scale" for row in result.ratios)
    other = {"met": "missed", "missed": "met", "not resolved": "met"}[row["verdict"]]
    assert findings(page, f"The ratio is {row['ratio']:.2f} (*{row['verdict']}*).") == []
    assert findings(page, f"The ratio is {row['ratio']:.2f} (*{other}*).")
    assert findings(page, "It took 123.456 seconds.")
    assert findings(page, "The guard's trace took 124 ms before.")
    assert not findings(page, "It took 124 ms, by [the report](https://example.org/report).")
    assert not findings(page, "As tensorflow#117319 says, 124 ms.")
    assert not findings(page, "See section 13 and exercises 2 and 3, and $1.234$ and `0.5`, and 1/(1−e^(−x)).")
    assert not findings(page, "Exercise 3 lists each ratio whose verdict is not \"not resolved\".")


def test_a_cited_page_or_file_is_checked_not_trusted():
    """A ``{doc}`` link backs only the numbers its page prints, a file only its literals; a Chinese verdict is
    checked like the English one."""
    intro = ROOT / "book" / "intro.md"
    assert not findings(intro, "Of the 1612 entries, 1442 ({doc}`case_a/clipping_and_guards`).")
    assert findings(intro, "Of the 1613 entries ({doc}`case_a/clipping_and_guards`).")
    page = ROOT / "book" / "reference" / "differences_from_fit.md"
    assert not findings(page, "After 20 steps (`companion/training/spikes.py`).")
    assert findings(page, "After 21 steps (`companion/training/spikes.py`).")
    performance = ROOT / "book" / "tools" / "performance.ipynb"
    rows = [row for result in _results() if result.benchmark != "scale" for row in result.ratios]
    met = {f"{row['ratio']:.2f}" for result in _results() for row in result.ratios if row["verdict"] == "met"}
    # A "not resolved" ratio that no met row shares (else "met" beside it would be backed).
    row = next(row for row in rows if row["verdict"] == "not resolved" and f"{row['ratio']:.2f}" not in met)
    assert not findings(performance, f"比值是 {row['ratio']:.2f}（*not resolved*，无法判定）。")
    assert findings(performance, f"比值是 {row['ratio']:.2f}，目标已达到。")
