"""Every cause's book section shows that cause's own example and its fix (issue 27, deliverable 6).

A section is a heading of a chapter and everything up to the next heading of the same or a
higher level: its markdown and its code. The checklist's *Common sources* section is a table
that :data:`companion.book.cases.CASES` fills (a case, the cause the doctor names for it, and
its safe form), so for it the rows of the cases filed under the cause count as its text.
"""

from __future__ import annotations

import json
import pathlib
import re

import pytest

import book_tools
from companion.book.cases import CASES as CHECKLIST
from companion.diagnostics import CAUSES

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = "book/closing/checklist#common-sources-each-in-a-few-lines"

#: For each cause, words of its example and words of its fix that its section must show.
SHOWS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "nonfinite_input": (("data", "0/0"), ("np.isfinite", "divide_no_nan")),
    "nonfinite_weights": (("skipped", "weights finite"), ("train(", "on_nonfinite")),
    "nonfinite_init": (("initializer", "log of a zero prior"), ("divide_no_nan", "np.isfinite")),
    "log_of_zero": (("log",), ("xlogy", "from logits")),
    "singular_derivative": (("norm at 0", "acos at 1"), ("double_where", "clip into (-1, 1)")),
    "pow_negative_base": (("-2.0", "negative"), ("signed_pow",)),
    "division_by_zero": (("x / (x + y) at 0, 0",), ("divide_no_nan",)),
    "overflow": (("log(1 + exp(100))", "float16 300 ** 2"), ("softplus", "square in float32")),
    "where_trap": (("tf.where",), ("double_where",)),
    "domain_edge": (("log", "negative"), ("softmax",)),
    "inf_arithmetic": (("softmax of (100, 0)",), ("tf.nn.softmax",)),
    "divergence": (("learning rate", "grows"), ("clipnorm", "smaller learning rate")),
    "label_out_of_range": (("sparse_categorical_crossentropy", "outside that range"),
                           ("labels from $0$", "labels.max() < C")),
    "learning_rate": (("schedule", "negative"), ("end_learning_rate", "floor")),
    "bootstrapped_targets": (("bootstrapped", "stop_gradient"), ("target network", "clipnorm")),
    "compiled_only": (("XLA",), ("jit_compile",)),
    "not_reproducible": (("does not reproduce",), ("save", "replay")),
    "nonfinite_update": (("epsilon=1e-8", "rounds to $0$ in `float16`", "the update makes the weights"),
                         ("epsilon=1e-4", "mixed_float16", "float32", "LossScaleOptimizer")),
    "unclassified": ((), ("locate_nonfinite",)),
}

#: Causes whose example no chapter shows yet (a chapter's notebook has to gain it).
MISSING_EXAMPLE = {
    "not_reproducible": "no chapter shows a NaN that does not reproduce on a re-run",
}


def _anchor(heading: str) -> str:
    make_id = pytest.importorskip("docutils.nodes").make_id
    return make_id(re.sub(r"[`$]", "", heading))


def section_text(section: str) -> str:
    """The markdown and code of ``chapter#anchor``, up to the next heading of its level or above."""
    chapter, _, anchor = section.partition("#")
    cells = json.loads((ROOT / f"{chapter}.ipynb").read_text())["cells"]
    level, lines = None, []
    for cell in cells:
        source = "".join(cell["source"]).splitlines()
        if cell["cell_type"] != "markdown":
            if level is not None:
                lines.extend(source)
            continue
        for line in source:
            heading = re.match(r"^(#+)\s+(.*)", line)
            if heading:
                depth = len(heading.group(1))
                if level is not None and depth <= level:
                    return "\n".join(lines)
                if _anchor(heading.group(2)) == anchor:
                    level = depth
            if level is not None:
                lines.append(line)
    assert level is not None, f"no section {section}"
    return "\n".join(lines)


def shown(cause: str) -> str:
    section = CAUSES[cause].section
    text = section_text(section)
    if section == TABLE:  # the rows the table shows for this cause
        text += "\n" + "\n".join(f"{name} | {case.fix_name}" for name, case in CHECKLIST.items()
                                 if case.cause == cause)
    return text


def test_every_cause_has_what_its_section_must_show():
    assert set(SHOWS) == set(CAUSES)


@pytest.mark.parametrize("cause", sorted(CAUSES))
def test_the_section_of_a_cause_shows_its_fix(cause):
    text = shown(cause)
    _, fix = SHOWS[cause]
    missing = [word for word in fix if word not in text]
    assert not missing, f"{cause}: {CAUSES[cause].section} does not show its fix: {missing}"


@pytest.mark.parametrize(
    "cause",
    [pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=MISSING_EXAMPLE[c])) if c in MISSING_EXAMPLE else c
     for c in sorted(CAUSES)],
)
def test_the_section_of_a_cause_shows_its_own_example(cause):
    text = shown(cause)
    example, _ = SHOWS[cause]
    missing = [word for word in example if word not in text]
    assert not missing, f"{cause}: {CAUSES[cause].section} does not show its example: {missing}"


def test_the_checklist_table_has_a_case_of_each_cause_that_points_to_it():
    for cause, entry in CAUSES.items():
        if entry.section == TABLE and cause != "unclassified":
            assert any(case.cause == cause for case in CHECKLIST.values()), cause


def test_the_api_page_shows_the_causes_table_rendered_from_causes():
    page = book_tools.API_PAGE.read_text()
    assert book_tools.causes_table() in page, (
        "book/reference/api.md's causes table is generated from companion.diagnostics.CAUSES: "
        "run `python scripts/refresh_notebooks.py --no-execute`"
    )
    assert book_tools.with_causes_table(page) == page
    for name, (description, fix, section) in CAUSES.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{name}` |"))
        assert description in row and fix in row and section.partition("#")[2] in row, name
