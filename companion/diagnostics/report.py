"""A :class:`~companion.diagnostics.Diagnosis` as text (lines of at most 80 characters) and as HTML."""

from __future__ import annotations

import html as _html
import os
import textwrap

WIDTH = 80
_LABEL = 13  # "  variables: " and the like


def _rows(diagnosis) -> list[tuple[str, str]]:
    d = diagnosis
    rows = []
    if d.epoch is not None:
        where = f"epoch {d.epoch}, batch {d.batch}"
        rows.append(("step", f"{where}: {d.symptom}" if d.symptom else where))
    elif d.batch is not None:
        rows.append(("batch", f"{d.batch}: {d.symptom}" if d.symptom else str(d.batch)))
    elif d.symptom:
        rows.append(("symptom", d.symptom))
    rows.append(("phase", d.phase))
    if d.worker is not None:
        rows.append(("worker", str(d.worker)))
    if d.op:
        rows.append(("op", d.op + (f" (gradient of {d.forward_op})" if d.forward_op else "")))
    if d.layer:
        rows.append(("layer", d.layer))
    if d.source:
        filename, _, line = d.source.rpartition(":")
        where = f"{os.path.basename(filename)}:{line}"
        rows.append(("line", where + (f": {d.code}" if d.code else "")))
    if d.dtype:
        rows.append(("dtype", d.dtype))
    if d.inputs_summary:
        rows.append((_summary_label(d), d.inputs_summary))
    if d.variables:
        more = f" (+{len(d.variables) - 3} more)" if len(d.variables) > 3 else ""
        rows.append(("variables", ", ".join(d.variables[:3]) + more))
    rows.append(("cause", f"{d.cause}: {d.description}"))
    if getattr(d, "remedy", None):
        rows.append(("remedy", d.remedy))
    if getattr(d, "verified", None):
        rows.append(("checked", d.verified))
    rows.append(("fix", d.fix))
    rows.append(("book", d.section))
    if d.mode_disagreement:
        rows.append(("modes", d.mode_disagreement))
    return rows


def _summary_label(d) -> str:
    """What the summary describes: the data, the weights, the op's inputs or its outputs."""
    if d.phase == "input":
        return "data"
    if d.phase == "weights":
        return "weights"
    summary = d.inputs_summary
    if " outputs of " in summary or " made " in summary or summary.startswith(("every op", "no ", "the same step")):
        return "values"
    return "inputs"


def text(diagnosis) -> str:
    """The diagnosis as labelled lines, each at most 80 characters."""
    lines = ["NaN doctor: " + (f"{diagnosis.cause} in {diagnosis.op}" if diagnosis.op else diagnosis.cause)]
    for label, value in _rows(diagnosis):
        head = f"  {label + ':':<{_LABEL - 2}}"
        wrapped = textwrap.wrap(
            value, WIDTH, initial_indent=head, subsequent_indent=" " * _LABEL,
            break_long_words=True, break_on_hyphens=False,
        )
        lines.extend(wrapped or [head.rstrip()])
    return "\n".join(lines)


def html(diagnosis) -> str:
    """The diagnosis as an HTML table (what a notebook shows)."""
    cells = "".join(
        f"<tr><th style='text-align:left;padding-right:1em'>{_html.escape(label)}</th>"
        f"<td style='text-align:left'>{_html.escape(value)}</td></tr>"
        for label, value in _rows(diagnosis)
    )
    title = _html.escape(f"NaN doctor: {diagnosis.cause}" + (f" in {diagnosis.op}" if diagnosis.op else ""))
    return f"<table class='nan-doctor'><caption style='text-align:left'><b>{title}</b></caption>{cells}</table>"
