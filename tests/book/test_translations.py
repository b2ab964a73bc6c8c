"""The Chinese edition (zh/) against the English book it is made from (scripts/translate_book.py).

- every unit of English text (a markdown cell, a block of a page, a site string) has a translation of its
  current English text: a missing or stale one fails, naming the page and the cell;
- every Chinese notebook has the English notebook's cells, with code, outputs, execution counts and metadata
  byte for byte the same; only the markdown sources differ, and the labels of the toggles that hide solution
  code (myst-nb's ``code_prompt_show``/``code_prompt_hide``), which are translated;
- zh/ is exactly what the script writes (nobody edited a generated file, nothing was left out);
- the translations are Chinese, keep the English's math and code, and use the glossary's terms;
- nbval never collects the Chinese notebooks (they would run the same code a second time).
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

import book_tools
from book_tools.zh import glossary, render, store, units

PAGES = units.english_pages()
NOTEBOOKS = [p for p in PAGES if p.suffix == ".ipynb"]
CJK = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff]")


def _name(path: pathlib.Path) -> str:
    return path.relative_to(book_tools.ROOT).as_posix()


def test_the_site_strings_have_current_translations():
    problems = store.translations(None)[1]
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_english_cell_has_a_current_translation(page):
    problems = store.translations(page)[1]
    assert not problems, (
        f"{len(problems)} units of {_name(page)} have no current translation "
        "(python scripts/translate_book.py --stale shows what changed):\n" + "\n".join(map(str, problems))
    )


def _without_prompts(cell: dict, check_chinese: list | None = None, index: int = 0) -> dict:
    """A code cell without the labels of its toggle (myst-nb's code_prompt_show/hide), the one part of a code
    cell the Chinese edition translates; with ``check_chinese``, a label that is not Chinese is reported there."""
    cell = json.loads(json.dumps(cell))
    mystnb = cell.get("metadata", {}).get("mystnb", {})
    for key in render.PROMPT_KEYS:
        label = mystnb.pop(key, None)
        if check_chinese is not None and label is not None and not CJK.search(label):
            check_chinese.append(f"cell {index} (id {cell['id']}): {key} {label!r} is not translated")
    if mystnb == {} and "mystnb" in cell.get("metadata", {}):
        del cell["metadata"]["mystnb"]
    return cell


@pytest.mark.parametrize("page", NOTEBOOKS, ids=_name)
def test_chinese_notebook_has_the_english_code_and_outputs(page):
    twin = render.zh_path(page)
    assert twin.is_file(), f"{_name(twin)} is missing: run python scripts/translate_book.py"
    english, chinese = (json.loads(p.read_text(encoding="utf-8")) for p in (page, twin))
    assert chinese["metadata"] == english["metadata"], f"{_name(twin)}: notebook metadata differ from the English"
    assert (chinese["nbformat"], chinese["nbformat_minor"]) == (english["nbformat"], english["nbformat_minor"])
    en_ids = [(c["cell_type"], c.get("id")) for c in english["cells"]]
    zh_ids = [(c["cell_type"], c.get("id")) for c in chinese["cells"]]
    assert zh_ids == en_ids, f"{_name(twin)}: its cells (type, id) are not the English notebook's"
    differing = []
    for index, (en, zh) in enumerate(zip(english["cells"], chinese["cells"])):
        if en["cell_type"] == "markdown":
            rest_en = {k: v for k, v in en.items() if k != "source"}
            rest_zh = {k: v for k, v in zh.items() if k != "source"}
            if rest_en != rest_zh:
                differing.append(f"cell {index} (id {en['id']}): markdown metadata or attachments")
            continue
        en, zh = _without_prompts(en), _without_prompts(zh, check_chinese=differing, index=index)
        for field in sorted(set(en) | set(zh)):
            if json.dumps(en.get(field), sort_keys=True) != json.dumps(zh.get(field), sort_keys=True):
                differing.append(f"cell {index} (id {en['id']}): {field}")
    assert not differing, f"{_name(twin)} differs from {_name(page)} in code cells:\n" + "\n".join(differing)


def test_chinese_tree_is_what_translate_book_writes():
    try:
        differences = render.differences()
    except render.Untranslated as error:
        pytest.fail(f"zh/ cannot be written: {len(error.problems)} units untranslated or stale, the first: "
                    f"{error.problems[0]}")
    assert not differences, "run python scripts/translate_book.py:\n" + "\n".join(differences)


def _prose(text: str) -> str:
    """Text without fenced blocks, math, inline code, roles' targets, links' URLs and HTML tags."""
    text = re.sub(r"^(```|:::).*?^\1[^\n]*$", " ", text, flags=re.S | re.M)
    text = re.sub(r"\$\$.*?\$\$", " ", text, flags=re.S)
    text = re.sub(r"\$[^$\n]+\$", " ", text)
    text = re.sub(r"`[^`]*`", " ", text)
    text = re.sub(r"\{[\w:-]+\}", " ", text)
    text = re.sub(r"\]\([^)]*\)", "]", text)
    text = re.sub(r"<[^>]+>", " ", text)
    return text


def _stored_units():
    for page in [None, *PAGES]:
        found = store.translations(page)[0]
        name = store.SITE_STORE.name if page is None else _name(page)
        for unit in units.of(page):
            if unit.key in found:
                yield name, unit, found[unit.key]


#: Chinese characters a translation has at least, per English word of the unit's prose (words of 3 letters or
#: more, outside code and math). Chinese takes about 1.5 to 2.5 characters for an English word; the lowest unit
#: of the book has 1.29 (the footer, mostly a licence's name); an English paragraph with a Chinese word in it
#: has nearly 0.
CJK_PER_ENGLISH_WORD = 0.8


def test_translations_are_chinese_wherever_the_english_has_prose():
    untranslated = []
    for name, unit, zh in _stored_units():
        words = re.findall(r"[A-Za-z]{3,}", _prose(unit.text))
        chinese = len(CJK.findall(_prose(zh)))
        if len(words) >= 3 and chinese < CJK_PER_ENGLISH_WORD * len(words):
            untranslated.append(f"{name}: {unit.key}: {chinese} Chinese characters for {len(words)} English words: "
                                f"{unit.text.splitlines()[0][:50]!r}")
    assert not untranslated, "English left untranslated, or translated only in part:\n" + "\n".join(untranslated)


_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def _inline_code(text: str) -> set[str]:
    text = re.sub(r"^(```|:::).*?^\1[^\n]*$", " ", text, flags=re.S | re.M)
    text = re.sub(r"\{[\w:-]+\}`[^`]*`", " ", text)  # roles: their targets are checked with the references
    return {" ".join(code.split()) for code in re.findall(r"`([^`]+)`", text)}


def test_translations_keep_the_numbers_and_identifiers_of_the_english():
    """Every number of a unit's prose (a measured ratio, a step, a count) and every identifier in inline code is in
    its translation too: a translation that dropped or changed one says something else than the English."""
    changed = []
    for name, unit, zh in _stored_units():
        missing = sorted(set(_NUMBER.findall(_prose(unit.text))) - set(_NUMBER.findall(_prose(zh))))
        spaced, bare = " ".join(zh.split()), "".join(zh.split())
        missing += sorted(c for c in _inline_code(unit.text) if c not in spaced and "".join(c.split()) not in bare)
        if missing:
            changed.append(f"{name}: {unit.key}: {missing[:5]}")
    assert not changed, "numbers or identifiers of the English missing from the translation:\n" + "\n".join(changed)


_TEXT_PHRASE = re.compile(r"\\text\{[^{}]*(?:\s|[\u4e00-\u9fff])[^{}]*\}")


def _kept(text: str) -> dict[str, list[str]]:
    """What a translation must keep from the English: math, cross-references, code blocks, directives."""
    display = re.findall(r"\$\$.*?\$\$", text, flags=re.S)
    inline = re.findall(r"\$[^$]+?\$", re.sub(r"\$\$.*?\$\$", "", text, flags=re.S))
    return {
        # a phrase in \text{} (words with a space between them, or Chinese) is prose, and is translated
        "display math": sorted(" ".join(_TEXT_PHRASE.sub(" ", m).split()) for m in display),
        # a translation may mention a symbol once more, or once less
        "inline math": sorted({" ".join(m.split()) for m in inline if "\n\n" not in m}),
        "references": sorted(re.findall(r"\{(?:doc|ref|cite|py:\w+|numref|eq)\}`[^`]*`", text)),
        # code blocks (```python, ```bash, ```); a ```{directive} holds prose and is translated
        "code blocks": sorted(re.findall(r"^```[\w+-]*\n.*?^```", text, flags=re.S | re.M)),
        "directives": sorted(re.findall(r"^(?::{3,}|`{3,})(\{[\w:-]+\})", text, flags=re.M)),
        # MyST labels (cross-reference targets) and the wrappers that hide solutions
        "labels": sorted(re.findall(r"^\([\w-]+\)=", text, flags=re.M)),
        "hidden solutions": re.findall(r'<details class="solution">|</details>', text),
    }


def _targets(references: list[str]) -> list[str]:
    """A reference's target, without the link text that a translation may change ({doc}`text <target>`)."""
    out = []
    for ref in references:
        role, body = ref.split("`", 1)
        body = body[:-1]
        match = re.search(r"<([^<>]+)>$", body)
        out.append(role + (match.group(1) if match else body))
    return sorted(out)


def test_translations_keep_the_math_references_code_and_directives_of_the_english():
    changed = []
    for name, unit, zh in _stored_units():
        en_kept, zh_kept = _kept(unit.text), _kept(zh)
        en_kept["references"], zh_kept["references"] = _targets(en_kept["references"]), _targets(
            [r for r in zh_kept["references"] if "glossary" not in r])
        for kind in en_kept:
            if kind == "inline math":  # everything the English has; the Chinese may add a symbol
                missing = sorted(set(en_kept[kind]) - set(zh_kept[kind]))
                if missing:
                    changed.append(f"{name}: {unit.key}: {kind} missing: {missing[:3]}")
            elif en_kept[kind] != zh_kept[kind]:
                missing = sorted(set(en_kept[kind]) - set(zh_kept[kind]))
                extra = sorted(set(zh_kept[kind]) - set(en_kept[kind]))
                changed.append(f"{name}: {unit.key}: {kind}: missing {missing[:2]}, added {extra[:2]}")
    assert not changed, "translations that change what must stay as in the English:\n" + "\n".join(changed)


def _glossary_rows() -> list[tuple[str, str, list[str]]]:
    rows = []
    for line in glossary.GLOSSARY_SOURCE.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and CJK.search(cells[0]) and cells[0] != "中文":
            rows.append((cells[0], cells[1], [w.strip() for w in cells[2].split("、") if w.strip()]))
    return rows


def test_the_glossary_lists_the_books_terms():
    rows = _glossary_rows()
    terms = {zh for zh, _, _ in rows}
    for required in ("梯度", "上溢", "下溢", "对数–指数幂"):
        assert any(required in term for term in terms), f"the glossary has no entry for {required}"
    assert any(en.startswith("ulp") for _, en, _ in rows)
    assert len(rows) >= 30


def test_every_page_uses_the_glossarys_terms_and_not_the_ones_it_rules_out():
    avoided = [(word, zh) for zh, _, words in _glossary_rows() for word in words]
    assert avoided, "the glossary rules out no translation: nothing to check"
    found = []
    for name, unit, zh in _stored_units():
        prose = _prose(zh)
        for word, term in avoided:
            if word in prose:
                found.append(f"{name}: {unit.key}: {word!r} (the glossary says {term!r})")
    assert not found, "\n".join(found)


def test_the_chinese_intro_says_that_outputs_stay_in_english():
    intro = render.zh_path(PAGES[0]).read_text(encoding="utf-8")
    assert re.search(r"输出.{0,40}英文", intro), "the Chinese intro must say once that the outputs stay in English"
    assert "glossary" in intro, "the Chinese intro links to the glossary"


@pytest.mark.slow
def test_nbval_collects_the_english_notebooks_and_no_chinese_one():
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "--nbval",
         "--nbval-current-env", "--no-header", "-o", "addopts=", "--ignore=tests", "--ignore=benchmarks",
         str(book_tools.ROOT)],
        cwd=book_tools.ROOT, capture_output=True, text=True, timeout=600,
    )
    items = [line for line in result.stdout.splitlines() if "::" in line]
    assert any(line.startswith("book/") and ".ipynb::" in line for line in items), result.stdout[-2000:]
    chinese = [line for line in items if line.startswith("zh/")]
    assert not chinese, f"pytest collects the Chinese notebooks: {chinese[:3]}"


def test_a_changed_english_cell_is_reported_stale_and_a_new_one_missing(tmp_path, monkeypatch):
    """The machinery itself, on a two-cell notebook: translated, then the English changed, then a cell added."""
    page = tmp_path / "chapter.ipynb"
    cells = [
        {"cell_type": "markdown", "id": "m1", "metadata": {}, "source": ["# Title\n", "\n", "Some text."]},
        {"cell_type": "code", "id": "c1", "metadata": {"tags": ["x"]}, "execution_count": 1,
         "outputs": [{"name": "stdout", "output_type": "stream", "text": ["1.0\n"]}], "source": ["print(1.0)"]},
    ]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    page.write_text(json.dumps(nb))
    monkeypatch.setattr(units, "english_pages", lambda: [page])
    store.import_units(page, f"{store.MARKER}m1\n# 标题\n\n一些文字。\n")
    found, problems = store.translations(page)
    assert problems == [] and found == {"m1": "# 标题\n\n一些文字。"}
    written = json.loads(render.chinese_notebook_text(page, found))
    assert written["cells"][0]["source"] == ["# 标题\n", "\n", "一些文字。"]
    assert written["cells"][1] == cells[1]

    cells[0]["source"] = ["# Title\n", "\n", "Some other text."]
    cells.insert(1, {"cell_type": "markdown", "id": "m2", "metadata": {}, "source": ["New."]})
    page.write_text(json.dumps(nb))
    problems = store.translations(page)[1]
    assert [(p.unit.key, p.unit.index, p.kind) for p in problems] == [("m1", 0, "stale"), ("m2", 1, "missing")]
    assert "chapter.ipynb: cell 0 (id m1): stale" in str(problems[0])
    assert problems[0].old_english == "# Title\n\nSome text."
    with pytest.raises(render.Untranslated, match="cell 1 \\(id m2\\): missing"):
        render.chinese_tree()


def test_rewrapped_keeps_a_translation_whose_english_only_moved_its_line_breaks(tmp_path, monkeypatch):
    """``--rewrapped``: English re-wrapped (line breaks and spaces) keeps its translation, with the new hash;
    English whose words changed stays stale."""
    page = tmp_path / "chapter.ipynb"
    cells = [{"cell_type": "markdown", "id": "m1", "metadata": {}, "source": ["Some text, wrapped\n", "here."]},
             {"cell_type": "markdown", "id": "m2", "metadata": {}, "source": ["Other text."]}]
    nb = {"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    page.write_text(json.dumps(nb))
    monkeypatch.setattr(units, "english_pages", lambda: [page])
    store.import_units(page, f"{store.MARKER}m1\n一些文字。\n{store.MARKER}m2\n别的文字。\n")
    cells[0]["source"] = ["Some text,\n", "wrapped  here."]
    cells[1]["source"] = ["Other words."]
    page.write_text(json.dumps(nb))
    assert [(p.unit.key, p.kind) for p in store.translations(page)[1]] == [("m1", "stale"), ("m2", "stale")]
    kept = store.refresh_rewrapped()
    assert len(kept) == 1 and "(id m1)" in kept[0]
    found, problems = store.translations(page)
    assert found == {"m1": "一些文字。"} and [(p.unit.key, p.kind) for p in problems] == [("m2", "stale")]
    assert store.refresh_rewrapped() == []


def test_a_fork_with_another_repository_url_needs_no_new_translation(monkeypatch):
    """refresh_notebooks.py rewrites the repository's URLs in the English pages of a fork; the stores keep
    the URLs as placeholders, so the translations stay current and carry the fork's URLs."""
    page = PAGES[0]
    original, fork = book_tools.repository_url(), "https://github.com/someone-else/nan-fork"
    found, problems = store.translations(page)
    assert not problems and any(original in zh for zh in found.values()), "the intro names the repository"
    rewritten = [
        units.Unit(u.key, u.index, u.text.replace(original, fork).replace(
            book_tools.pages_url(original), book_tools.pages_url(fork)))
        for u in units.units_of(page)
    ]
    monkeypatch.setattr(book_tools.settings, "repository_url", lambda: fork)
    monkeypatch.setattr(units, "units_of", lambda _page: rewritten)
    found_fork, problems = store.translations(page)
    assert not problems, "\n".join(map(str, problems))
    assert not any(original in zh for zh in found_fork.values())
    assert any(fork in zh for zh in found_fork.values())


def _chinese_page_units(page: pathlib.Path) -> list[str]:
    """The Chinese page's markdown: one string per markdown cell of a notebook, or the whole page."""
    twin = render.zh_path(page)
    if twin.suffix == ".ipynb":
        cells = json.loads(twin.read_text(encoding="utf-8"))["cells"]
        return ["".join(c["source"]) for c in cells if c["cell_type"] == "markdown"]
    return [twin.read_text(encoding="utf-8")]


def _chinese_page_prose(page: pathlib.Path) -> str:
    return "\n\n".join(_chinese_page_units(page))


#: What is not running text, written here independently of translate_book's own pattern (a test that shared the
#: script's pattern would share its bugs): fenced blocks and display math across lines; inline math, code and
#: roles, links (markdown, or HTML with their text) and HTML tags; and heading, directive and option lines, each only to the end of its line.
_NOT_RUNNING_TEXT = re.compile(
    r"^(```|:::)[^\n]*\n(?:.*\n)*?\1[^\n]*$"
    r"|\$\$(?:[^$]|\$(?!\$))*\$\$|\$[^$]+\$"
    r"|`[^`]*`|\[[^\]]*\]\([^)]*\)|<a\s[^>]*>[^<]*</a>|<[^>]+>"
    r"|^#{1,6} [^\n]*$|^:{3,}[^\n]*$|^`{3,}[^\n]*$|^:[\w-]+:[^\n]*$",
    re.M,
)


def _running_text_spans(text: str) -> list[tuple[int, int]]:
    return [m.span() for m in _NOT_RUNNING_TEXT.finditer(text)]


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_page_gives_the_english_of_a_glossary_term_at_its_first_use(page):
    terms = glossary.glossary_terms()
    first: dict[str, tuple[str, int, int]] = {}
    for text in _chinese_page_units(page):
        protected = _running_text_spans(text)
        for term, _ in terms:
            if term in first:
                continue
            for match in re.finditer(re.escape(term), text):
                start = match.start()
                if any(a <= start < b for a, b in protected):
                    continue
                longer = [t for t, _ in terms if len(t) > len(term) and term in t]
                if any(text.startswith(t, start - t.index(term)) for t in longer):
                    continue  # part of a longer term, which has its own English
                first[term] = (text, start, match.end())
                break
    english = dict(terms)
    bare = [f"{term} ({english[term]}): ...{text[max(0, start - 15):end + 5]}..."
            for term, (text, start, end) in first.items() if not re.match(r"[（(，]", text[end:end + 1])]
    assert not bare, f"{_name(page)}: glossary terms without their English at their first use:\n" + "\n".join(bare)


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_page_gives_the_english_of_a_glossary_term_once(page):
    text = _chinese_page_prose(page)
    twice = []
    for term, english in glossary.glossary_terms():
        glosses = re.findall(f"{re.escape(term)}[（(，]\\s*{re.escape(english)}[）)，,]", text, flags=re.I)
        if len(glosses) > 1:
            twice.append(f"{term} ({english}): {len(glosses)} times")
    assert not twice, f"{_name(page)}: a glossary term's English given more than once:\n" + "\n".join(twice)


def test_the_annotation_reads_past_a_heading_and_merges_with_a_parenthesis():
    """The regression of issue 29: a heading protected its whole unit, so terms after it never got their English;
    and a term followed by a parenthesis got a second pair of them."""
    terms = [("上溢", "overflow"), ("检查点", "checkpoint")]
    texts = ["## 1. 标题\n\n在 `float16` 中会上溢；之后再次上溢。", "检查点（`train(checkpoint_dir=...)`）写在这里。"]
    assert glossary.annotate_first_uses(texts, terms) == [
        "## 1. 标题\n\n在 `float16` 中会上溢（overflow）；之后再次上溢。",
        "检查点（checkpoint，`train(checkpoint_dir=...)`）写在这里。",
    ]
    by_hand = ["上溢（overflow）一次。", "又上溢（overflow）一次。"]
    assert glossary.annotate_first_uses(by_hand, terms) == ["上溢（overflow）一次。", "又上溢一次。"]


def test_the_chinese_pages_have_no_line_break_between_two_chinese_characters():
    """A browser renders a line break inside a paragraph as a space, which Chinese text does not have
    (render.join_cjk_lines joins them when it writes the pages)."""
    cjk = r"[\u3000-\u303f\u3400-\u4dbf\u4e00-\u9fff\uff00-\uffef]"
    found = []
    glossary = render.ZH / (render.GLOSSARY_DOC + ".md")
    for page, texts in [*((p, _chinese_page_units(p)) for p in PAGES), (glossary, [glossary.read_text("utf-8")])]:
        for text in texts:
            blocks = [m.span() for m in re.finditer(r"^(```|:::)[^\n]*\n(?:.*\n)*?\1|\$\$(?:[^$]|\$(?!\$))*\$\$",
                                                     text, re.M)]
            for match in re.finditer(f"{cjk}[ \\t]*\n[ \\t]*{cjk}", text):
                if not any(a <= match.start() < b for a, b in blocks):
                    found.append(f"{_name(page)}: {match.group(0)!r}")
    assert not found, f"{len(found)} line breaks between Chinese characters, the first: " + ", ".join(found[:5])


def test_exercise_labels_and_parentheses_are_written_as_chinese_text_writes_them():
    found = []
    for page in PAGES:
        prose = _prose(_chinese_page_prose(page))
        found += [f"{_name(page)}: {m!r}" for m in re.findall(r"\*\*练习 \d+\.\*\*", prose)]
        found += [f"{_name(page)}: {m!r}" for m in re.findall(r".{0,12}[）)][（(].{0,12}", prose)]
    assert not found, "an exercise label with an ASCII period, or two pairs of parentheses in a row:\n" + "\n".join(
        found)


_LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")


def test_translations_keep_the_link_targets_of_the_english_anchors_included():
    """A markdown link of a translation goes where the English one goes, to the same section: the causes table of
    the API page once lost its 13 anchors (checklist.ipynb instead of checklist.ipynb#common-sources-...)."""
    changed = []
    for name, unit, zh in _stored_units():
        en_targets, zh_targets = sorted(_LINK_TARGET.findall(unit.text)), sorted(_LINK_TARGET.findall(zh))
        if en_targets != zh_targets:
            missing = sorted(set(en_targets) - set(zh_targets))
            extra = sorted(set(zh_targets) - set(en_targets))
            changed.append(f"{name}: {unit.key}: missing {missing[:3]}, added {extra[:3]}")
    assert not changed, "links whose target differs from the English:\n" + "\n".join(changed)


def test_the_fixed_headings_are_written_as_d2l_zh_writes_them():
    """小结 for What to remember, 练习 for Exercises, 结语 for the closing part, 参考资料 for the references."""
    site = store.translations(None)[0]
    expected = {"What to remember": "小结", "Exercises": "练习"}
    wrong = []
    for name, unit, zh in _stored_units():
        en_headings = re.findall(r"^#{1,6} (.*)$", unit.text, re.M)
        zh_headings = re.findall(r"^#{1,6} (.*)$", zh, re.M)
        for en, heading in zip(en_headings, zh_headings):
            if en.strip() in expected and heading.strip() != expected[en.strip()]:
                wrong.append(f"{name}: {unit.key}: {heading!r} for {en!r}")
    captions = {unit.text: site[unit.key] for unit in units.site_units() if unit.key.startswith("caption")}
    assert captions["Closing"] == "结语" and captions["Reference"] == "参考资料", captions
    assert not wrong, "\n".join(wrong)


SEEDS = book_tools.ROOT / "tests" / "data" / "seeds"


def test_the_chinese_edition_quotes_the_askers_and_the_answers_in_their_own_words():
    """Both questions and both answers were written in Chinese (tests/data/seeds/, as received): where the English
    translates a quotation of them (marked "(translated)", and every quotation of the audit page), the Chinese
    quotes the original verbatim instead of translating the English back."""
    seeds = re.sub(r"\s+", "", "".join(p.read_text(encoding="utf-8") for p in sorted(SEEDS.glob("*.txt"))))
    assert len(seeds) > 3000, "the two seeds are missing"
    quoting = [render.ROOT / "book" / "closing" / "answers_audited.md"]
    not_verbatim, checked = [], 0
    for name, unit, zh in _stored_units():
        if "(translated)" not in unit.text and not any(name == _name(p) for p in quoting):
            continue
        for quote in re.findall(r"“([^”]+)”", zh):
            if len(CJK.findall(quote)) >= 4:
                checked += 1
                if re.sub(r"\s+", "", quote) not in seeds:
                    not_verbatim.append(f"{name}: {unit.key}: “{quote[:60]}”")
    assert checked >= 10, f"only {checked} quotations of the seeds found"
    assert not not_verbatim, "quotations that are not the seeds' own words:\n" + "\n".join(not_verbatim)


def test_the_chinese_section_links_land_on_an_anchor_of_the_chinese_page():
    """A link to a section of another page is written into the Chinese tree as an HTML link to the English
    section's id (MyST would look for a Chinese heading's slug and warn), and that id is an anchor of the
    Chinese page (render.with_english_anchors puts it before the heading)."""
    links, missing = 0, []
    for page in PAGES:
        for text in _chinese_page_units(page):
            for target, anchor in re.findall(r'<a href="([^"#:]+)\.html#([\w-]+)">', text):
                links += 1
                base = (render.zh_path(page).parent / target).resolve()
                twin = next((base.with_suffix(s) for s in (".ipynb", ".md") if base.with_suffix(s).is_file()), None)
                if twin is None or not re.search(rf'id=\\?"{re.escape(anchor)}\\?"', twin.read_text("utf-8")):
                    missing.append(f"{_name(page)}: {target}#{anchor}")
    assert links >= 13, f"only {links} section links in the Chinese pages (the API page's causes table has 13)"
    assert not missing, "section links without their anchor:\n" + "\n".join(missing)


def test_each_row_of_a_table_is_a_unit_of_its_own_so_a_new_cause_is_one_new_unit():
    texts = [u.text for u in units.units_of(book_tools.API_PAGE)]
    header, rule, *rows = book_tools.causes_table().split("\n")
    assert f"{header}\n{rule}" in texts
    assert all(row in texts for row in rows)
    page = "intro\n\n| a | b |\n|---|---|\n| 1 | 2 |\n| 3 | 4 |\n\nend\n"
    pieces = units.md_blocks(page)
    assert [block for block, _ in pieces] == ["intro", "| a | b |\n|---|---|", "| 1 | 2 |", "| 3 | 4 |", "end"]
    assert units.join_md_blocks(pieces) == page
