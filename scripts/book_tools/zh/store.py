"""The translation stores: ``<page>.zh.json`` beside each page and ``_site.zh.json``, looked up by a unit's
key and the hash of its English; the problems (missing, stale); the export and import of units."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import pathlib
import re

from .. import settings
from . import units
from .units import Unit

SITE_STORE = settings.ROOT / "_site.zh.json"
STORE_SUFFIX = ".zh.json"
MARKER = "%%% unit "  # the line that opens a unit in --export/--import files
SAME = "="  # a unit imported as this one line is stored as its English text (code, a module's directive)


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _site_urls() -> list[tuple[str, str]]:
    """The repository's and the book's URL (from _config.yml), each with the placeholder the stores use."""
    url = settings.repository_url()
    return [(url, "<<REPOSITORY_URL>>"), (settings.pages_url(url), "<<PAGES_URL>>")]


#: Stands for the git ref the install lines name (``cells.install_ref``: a release's tag, or the
#: development branch) in the stores, so that releasing rewrites no translation.
INSTALL_REF = "<<INSTALL_REF>>"


def _install_line(ref: str) -> re.Pattern:
    return re.compile(re.escape(f"git+<<REPOSITORY_URL>>@{ref}") + r"(?![\w./-])")


def normalize(text: str) -> str:
    """``text`` with the site's URLs as placeholders: the stores hash and keep this form, so that a fork
    (another ``repository.url``, links rewritten by ``refresh_notebooks.py``) needs no new translation;
    and the ref of an install line as one too, so that a release needs none either."""
    for real, placeholder in _site_urls():
        text = text.replace(real, placeholder)
    if "git+<<REPOSITORY_URL>>@" in text:
        from ..cells import install_ref

        text = _install_line(install_ref()).sub(f"git+<<REPOSITORY_URL>>@{INSTALL_REF}", text)
    return text


def denormalize(text: str) -> str:
    if INSTALL_REF in text:
        from ..cells import install_ref

        text = text.replace(INSTALL_REF, install_ref())
    for real, placeholder in _site_urls():
        text = text.replace(placeholder, real)
    return text


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


def store_path(page: pathlib.Path | None) -> pathlib.Path:
    """The store of ``page``'s translations (None: the site's strings)."""
    return SITE_STORE if page is None else page.with_name(page.stem + STORE_SUFFIX)


def page_name(page: pathlib.Path | None) -> str:
    """How messages and stores name ``page`` (None: the site's strings)."""
    return SITE_STORE.name if page is None else settings.rel(page)


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


def lookup(entries: dict, unit: Unit) -> tuple[str | None, tuple | None]:
    """The translation of ``unit`` in a store's ``entries`` (by key and hash, else by hash alone: a cell that
    moved), or None and the problem's fields: ("missing",) or ("stale", old English, old Chinese)."""
    digest = sha256(normalize(unit.text))
    entry = entries.get(unit.key)
    if entry is not None and entry["en_sha256"] == digest:
        return denormalize(entry["zh"]), None
    for other in entries.values():
        if other["en_sha256"] == digest:
            return denormalize(other["zh"]), None
    if entry is None:
        return None, ("missing",)
    return None, ("stale", denormalize(entry.get("en", "")), denormalize(entry["zh"]))


def translations(page: pathlib.Path | None) -> tuple[dict[str, str], list[Problem]]:
    """Every unit key of ``page`` (None: the site strings) mapped to its translation, and the problems."""
    wanted = units.of(page)
    store = load_store(store_path(page))
    name = page_name(page)
    found, problems = {}, []
    for unit in wanted:
        zh, problem = lookup(store["units"], unit)
        if problem is None:
            found[unit.key] = zh
        else:
            problems.append(Problem(name, unit, *problem))
    return found, problems


def all_problems() -> list[Problem]:
    problems = translations(None)[1]
    for page in units.english_pages():
        problems.extend(translations(page)[1])
    return problems


# --- export and import of units, for translating ---------------------------------------------------------------

def export_units(page: pathlib.Path | None, only_problems: bool) -> str:
    wanted = units.of(page)
    problems = {p.unit.key for p in translations(page)[1]}
    parts = []
    for unit in wanted:
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
    wanted = {u.key: u for u in units.of(page)}
    path = store_path(page)
    store = load_store(path)
    entries = store["units"]
    new = parse_units(text)
    unknown = sorted(set(new) - set(wanted))
    if unknown:
        raise SystemExit(f"{path.name}: no English unit with the keys {unknown}")
    for key, zh in new.items():
        if zh.strip() == SAME:
            zh = wanted[key].text
        if page is not None and page.suffix == ".md" and wanted[key].text.strip() and not zh.strip():
            raise SystemExit(f"{path.name}: empty translation for {key}")
        en = normalize(wanted[key].text)
        entries[key] = {"en_sha256": sha256(en), "en": en, "zh": normalize(zh)}
    ordered = {k: entries[k] for k in wanted if k in entries}
    ordered.update({k: v for k, v in entries.items() if k not in ordered})  # kept: an old cell may come back
    save_store(path, page_name(page), ordered)
    return len(new)


def prune_stores() -> None:
    """Drop stored entries whose key no longer exists and whose hash matches no current unit."""
    for page in [None, *units.english_pages()]:
        wanted = units.of(page)
        path = store_path(page)
        if not path.exists():
            continue
        store = load_store(path)
        keys, hashes = {u.key for u in wanted}, {sha256(normalize(u.text)) for u in wanted}
        kept = {k: v for k, v in store["units"].items() if k in keys or v["en_sha256"] in hashes}
        if kept != store["units"]:
            save_store(path, store.get("source", path.name), kept)


def refresh_rewrapped() -> list[str]:
    """Keep the translations of units whose English changed only in line breaks and spaces (text re-wrapped):
    their hash and stored English are updated, the Chinese is kept. Returns the units refreshed."""
    refreshed = []
    for page in [None, *units.english_pages()]:
        problems = [p for p in translations(page)[1] if p.kind == "stale"]
        if not problems:
            continue
        path = store_path(page)
        store = load_store(path)
        for problem in problems:
            if " ".join(problem.old_english.split()) == " ".join(problem.unit.text.split()):
                en = normalize(problem.unit.text)
                store["units"][problem.unit.key].update({"en_sha256": sha256(en), "en": en})
                refreshed.append(str(problem))
                save_store(path, store.get("source", path.name), store["units"])
    return refreshed


def stale_report() -> str:
    lines = []
    for problem in all_problems():
        lines.append(str(problem))
        if problem.old_english is not None:
            diff = difflib.unified_diff(problem.old_english.splitlines(), problem.unit.text.splitlines(),
                                        "translated English", "current English", lineterm="", n=1)
            lines.extend("    " + line for line in diff)
    return "\n".join(lines)


