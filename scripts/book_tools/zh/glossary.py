"""The glossary (``book/glossary.zh.md``): each term's English once per page, at its first use in running text."""

from __future__ import annotations

import re

from .. import settings

GLOSSARY_SOURCE = settings.ROOT / "book" / "glossary.zh.md"

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

