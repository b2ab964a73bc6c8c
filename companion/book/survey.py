"""The survey of public NaN reports behind the book's checklist chapter.

:func:`load_reports` reads ``companion/book/data/nan_reports.csv``: public NaN reports
(TensorFlow, Keras and other projects' issue trackers, Q&A pages, forums and blogs), each
with its URL, the pattern it shows (a row of the checklist, :data:`PATTERNS`) and its cause,
named as ``companion.diagnostics.CAUSES`` names causes. :func:`cause_counts` and
:func:`pattern_counts` count them, so the chapter's table is computed, not typed.

A *pattern* is a row of the checklist (what the reporter's code did, e.g.
``log_of_negative``); a *cause* is what the NaN doctor names (e.g. ``log_of_zero``). The
two vocabularies are different on purpose: several patterns share a cause. The cases, one
per row, are in :mod:`companion.book.cases`.

Part of the book's support code (:mod:`companion.book`): no stability promise.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import pathlib

__all__ = ["PATTERNS", "SURVEY_FILE", "Report", "cause_counts", "load_reports", "pattern_counts"]

#: The survey's data file (comma-separated, one public report a line).
SURVEY_FILE = pathlib.Path(__file__).parent / "data" / "nan_reports.csv"

#: Checklist row of each pattern a report can show (the ``pattern`` column of the survey).
PATTERNS: dict[str, str] = {
    "norm_at_zero": "the norm of a zero vector",
    "sqrt_at_zero": "sqrt at 0",
    "sqrt_of_negative": "sqrt of a negative value (a variance below 0)",
    "pow_below_one": "x^p with p < 1 at 0",
    "acos_asin": "acos/asin at ±1 (or past it)",
    "atan2_angle": "atan2 and angle at 0",
    "crossentropy_probabilities": "cross-entropy on probabilities",
    "log_of_negative": "log of a negative value",
    "log_at_zero": "log of an exact 0 (not a probability)",
    "reduce_std": "reduce_std of a constant",
    "single_sample_variance": "the unbiased variance of one sample",
    "zero_variance_norm": "zero-variance normalisation",
    "cosine_zero_vector": "cosine similarity of a zero vector",
    "learning_rate": "a learning rate that is too large",
    "softplus_logsigmoid": "softmax/softplus/log-sigmoid/logcosh overflow",
    "exp_overflow": "exp of a large value",
    "where_trap": "the tf.where trap",
    "pow_negative_base": "a power of a negative base",
    "float16_range": "float16 range (mixed precision)",
    "attention_mask": "an attention mask of ±inf or -1e9",
    "inf_logits": "an infinite logit",
    "svd_degenerate": "SVD or eigh with equal values",
    "division": "a division by zero",
    "lgamma_pole": "lgamma or digamma at a pole",
    "data": "NaN in the data",
    "label_out_of_range": "a class label outside [0, num_classes)",
    "compiled_only": "only in compiled code",
    "init_log_prior": "a bias set to the log of a zero prior",
    "data_dependent_init": "a data-dependent initialisation over a spread of 0",
    "lr_schedule": "a learning-rate schedule (warmup, decay, its division)",
    "bootstrapped_targets": "targets bootstrapped from the model (TD, Q-learning)",
    "class_count_weights": "class weights n/0 from class counts",
    "special_function_overflow": "a special function that overflows (Gamma, Bessel)",
    "cholesky_float32": "Cholesky of a matrix that is not positive definite in float32",
    "sampler_endpoint": "a sampler that returns its interval's end (0 or 1)",
    "unresolved": "not resolved in the thread",
}


@dataclasses.dataclass(frozen=True)
class Report:
    """One public NaN report of the survey.

    Attributes:
        url: where it is (an issue, pull request, Q&A page, forum thread or blog post).
        framework: the library it was reported against (``tensorflow``, ``keras``,
            ``pytorch``, ``jax``, ...).
        kind: ``issue``, ``qa``, ``forum`` or ``blog``.
        pattern: the checklist row it belongs to, a key of :data:`PATTERNS`.
        cause: the cause, a name of ``companion.diagnostics.CAUSES``
            (``compiled_only`` for a NaN that only compiled code makes), or
            ``unresolved`` when the thread never found it.
        basis: ``stated`` when the reporter or a maintainer names the mechanism in the
            thread, ``inferred`` when the classification is this survey's reading of it.
        summary: one line on what failed.
    """

    url: str
    framework: str
    kind: str
    pattern: str
    cause: str
    basis: str
    summary: str


def load_reports(path: str | pathlib.Path | None = None) -> tuple[Report, ...]:
    """Read the survey of public NaN reports.

    Args:
        path: a CSV file with the columns of :class:`Report`; default :data:`SURVEY_FILE`.

    Returns:
        The reports, in the file's order.

    Raises:
        ValueError: if a row has more or fewer fields than :class:`Report`, its pattern
            is not a key of :data:`PATTERNS`, or a URL appears twice.

    Example:
        >>> reports = load_reports()
        >>> len(reports) >= 250
        True
        >>> sorted({r.kind for r in reports})
        ['blog', 'forum', 'issue', 'qa']
    """
    fields = [field.name for field in dataclasses.fields(Report)]
    with open(path or SURVEY_FILE, newline="", encoding="utf-8") as file:
        rows = list(csv.DictReader(file))
    for line, row in enumerate(rows, 2):
        if None in row or None in row.values():
            count = len(fields) + len(row.get(None, ())) - sum(v is None for v in row.values())
            raise ValueError(
                f"{path or SURVEY_FILE}: line {line} has {count} fields; expected {len(fields)} ({', '.join(fields)}); "
                "a comma in the summary?"
            )
    reports = tuple(Report(**row) for row in rows)
    seen = set()
    for report in reports:
        if report.pattern not in PATTERNS:
            raise ValueError(f"{report.url}: unknown pattern {report.pattern!r}; expected one of {sorted(PATTERNS)}")
        if report.url in seen:
            raise ValueError(f"{report.url} appears twice in the survey")
        seen.add(report.url)
    return reports


def _tensorflow_only(reports, frameworks):
    return [r for r in reports if frameworks is None or r.framework in frameworks]


def cause_counts(reports, frameworks: tuple[str, ...] | None = None) -> list[tuple[str, int]]:
    """How often each cause recurs in ``reports``, most frequent first.

    Args:
        reports: :class:`Report` records, e.g. from :func:`load_reports`.
        frameworks: count only reports against these frameworks (for example
            ``("tensorflow", "keras")``); None counts all.

    Returns:
        A list of ``(cause, count)``, by count and then by name.

    Example:
        >>> cause_counts([r for r in load_reports() if r.pattern == "where_trap"])
        [('where_trap', 11)]
    """
    counter = collections.Counter(r.cause for r in _tensorflow_only(reports, frameworks))
    return sorted(counter.items(), key=lambda item: (-item[1], item[0]))


def pattern_counts(reports, frameworks: tuple[str, ...] | None = None) -> list[tuple[str, str, int]]:
    """How often each pattern (checklist row) recurs, with the cause it is filed under.

    Args:
        reports: :class:`Report` records.
        frameworks: as for :func:`cause_counts`.

    Returns:
        A list of ``(pattern, cause, count)``, by count and then by pattern; a pattern
        whose reports name different causes has one entry per cause.

    Example:
        >>> pattern_counts([r for r in load_reports() if r.pattern == "learning_rate"])
        [('learning_rate', 'divergence', 8)]
    """
    counter = collections.Counter((r.pattern, r.cause) for r in _tensorflow_only(reports, frameworks))
    return sorted(((p, c, n) for (p, c), n in counter.items()), key=lambda item: (-item[2], item[0], item[1]))
