"""The Chinese tree ``zh/``: each English page with its translations put in, and the book's configuration."""

from __future__ import annotations

import copy
import os
import pathlib
import re

from .. import settings
from . import glossary, store, units
from .store import Problem

ROOT = settings.ROOT
ZH = ROOT / "zh"
GLOSSARY_DOC = "book/glossary"
COPIED = ("book/references.bib",)


class Untranslated(Exception):
    def __init__(self, problems: list[Problem]):
        super().__init__("\n".join(map(str, problems)))
        self.problems = problems


def zh_path(page: pathlib.Path) -> pathlib.Path:
    """Where the Chinese twin of an English source (a path under ROOT) is written."""
    return ZH / page.resolve().relative_to(ROOT)


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


_HEADING_LINE = re.compile(r"^#{1,6} .*$", re.M)


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

    nb = units.read_notebook(page)
    zh = copy.deepcopy(nb)
    for cell in zh["cells"]:
        mystnb = cell.get("metadata", {}).get("mystnb", {})
        for key in PROMPT_KEYS:
            if isinstance(mystnb.get(key), str):
                mystnb[key] = _translated_prompt(mystnb[key])
    markdown = [cell for cell in zh["cells"] if cell["cell_type"] == "markdown"]
    for cell, text in zip(markdown, glossary.annotate_first_uses([found[cell["id"]] for cell in markdown])):
        text = html_section_links(join_cjk_lines(with_english_anchors("".join(cell["source"]), text)))
        cell["source"] = text.splitlines(keepends=True)
    return nbformat.writes(nbformat.from_dict(zh)) + "\n"


def chinese_page_text(page: pathlib.Path, found: dict[str, str]) -> str:
    pieces = units.md_blocks(page.read_text(encoding="utf-8"))
    keys = [i for i, (block, _) in enumerate(pieces) if block.strip() and f"b{i}" in found]
    annotated = dict(zip(keys, glossary.annotate_first_uses([found[f"b{i}"] for i in keys])))
    annotated = {i: html_section_links(join_cjk_lines(with_english_anchors(pieces[i][0], text)))
                 for i, text in annotated.items()}
    return units.join_md_blocks([(annotated.get(i, block), separator) for i, (block, separator) in enumerate(pieces)])


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
        "# _build/html/zh/ by the English build (scripts/book_tools/sphinx_zh.py).\n"
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
    """Every file of zh/, as `scripts/translate_book.py` writes it.

    Args:
        draft: put the old translation where one is stale and the English text where one is missing, instead
            of failing (to try a build while translating; ``--check`` and the tests fail on a draft).

    Raises:
        Untranslated: naming every unit without a current translation.
    """
    files: dict[pathlib.Path, bytes] = {}
    site, problems = store.translations(None)
    if draft:
        site.update({p.unit.key: p.old_chinese or p.unit.text for p in problems})
        problems = []
    for page in units.english_pages():
        found, page_problems = store.translations(page)
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
    files[ZH / (GLOSSARY_DOC + ".md")] = join_cjk_lines(glossary.GLOSSARY_SOURCE.read_text(encoding="utf-8")).encode("utf-8")
    for name in COPIED:
        files[ZH / name] = (ROOT / name).read_bytes()
    return files


def generated_files_on_disk() -> set[pathlib.Path]:
    return {
        p for p in ZH.rglob("*")
        if p.is_file() and "_build" not in p.parts and ".ipynb_checkpoints" not in p.parts
    }


def differences() -> list[str]:
    """The files of zh/ that differ from what `scripts/translate_book.py` writes (Untranslated if it cannot write them)."""
    files = chinese_tree()
    out = []
    for path, data in sorted(files.items()):
        if not path.exists():
            out.append(f"{settings.rel(path)}: missing")
        elif path.read_bytes() != data:
            out.append(f"{settings.rel(path)}: differs from what scripts/translate_book.py writes")
    for path in sorted(generated_files_on_disk() - set(files)):
        out.append(f"{settings.rel(path)}: not written by scripts/translate_book.py (left over?)")
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


