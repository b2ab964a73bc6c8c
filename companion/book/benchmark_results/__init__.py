"""The measured cost of the book's fixes, shipped with the package.

The scripts in the repository's ``benchmarks/`` folder write their results as JSON files
into this package's folder (``python benchmarks/tilted_mean.py --json tilted_mean.json``),
one file per benchmark and CPU type, so that the performance chapter
(``book/tools/performance.ipynb``) can show them wherever it runs, in Colab too, without a
checkout of the repository. :func:`load_results` reads them.

Each file is a JSON object with at least ``benchmark`` (its name), ``ratios`` (a list of
objects with ``label``, ``ratio``, ``target``, and the quartiles ``q1``, ``q3`` of the
per-round ratios; a ratio is "lower is better"), and where and how it was measured
(``date``, ``command``, ``machine``, ``tensorflow``, ``keras``, and the CPU model where
recorded). Further fields are kept, in :attr:`BenchmarkResult.document`.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json
import os
import pathlib
import re
from typing import Any, Mapping

__all__ = ["BenchmarkResult", "load_results", "results_directory", "short_cpu_name"]

_RATIO_FIELDS = ("label", "ratio", "target")


@dataclasses.dataclass(frozen=True)
class BenchmarkResult:
    """One benchmark's results from one run, on one machine.

    Attributes:
        benchmark: the benchmark's name, e.g. ``"tilted_mean"``.
        cpu: the CPU it ran on: the recorded CPU model, or, in files that do not record
            it, the machine's description (``"2 CPU cores (x86_64), no GPU"``).
        ratios: one dict per measured ratio, with at least ``label``, ``ratio``,
            ``target`` and ``met`` (``ratio <= target``), the quartiles ``q1`` and
            ``q3`` of the per-round ratios (equal to ``ratio`` where the file has
            none), and ``verdict``: ``"met"`` if even ``q3`` is at most the target,
            ``"missed"`` if even ``q1`` is above it, else ``"not resolved"`` (the
            spread of the rounds straddles the target, so the run cannot tell).
        document: the whole JSON object as read, with every field it has.
        source: the file's name.
        onednn: whether TensorFlow's oneDNN kernels were on (``True``/``False``), or
            ``None`` where the file does not record it.
        vector: the CPU's widest vector extension where the file records its flags
            (``"AVX-512"``, ``"AVX2"``, ``"AVX"``), else ``None``: one model name (``"AMD
            EPYC"``) covers CPUs with and without AVX-512, whose kernels and ratios differ.
    """

    benchmark: str
    cpu: str
    ratios: tuple[dict[str, Any], ...]
    document: Mapping[str, Any]
    source: str
    onednn: bool | None = None
    vector: str | None = None

    @property
    def setting(self) -> str:
        """The CPU (with its widest vector extension, where recorded) and the oneDNN setting.

        E.g. ``"AMD EPYC, oneDNN off"``, or ``"AMD EPYC AVX-512, oneDNN on"``: how results differ.

        Example:
            >>> BenchmarkResult.from_document({
            ...     "benchmark": "b", "cpu": "AMD EPYC", "onednn": {"enabled": False}, "ratios": [],
            ... }).setting
            'AMD EPYC, oneDNN off'
        """
        onednn = {True: "oneDNN on", False: "oneDNN off", None: "oneDNN not recorded"}[self.onednn]
        cpu = f"{self.cpu} {self.vector}" if self.vector else self.cpu
        return f"{cpu}, {onednn}"

    @classmethod
    def from_document(cls, document: Mapping[str, Any], source: str = "<document>") -> BenchmarkResult:
        """A result from a JSON object as the benchmarks write it.

        Args:
            document: the parsed JSON object.
            source: where it comes from, for error messages.

        Returns:
            The :class:`BenchmarkResult`.

        Raises:
            ValueError: if ``benchmark`` or ``ratios`` is missing, or a ratio lacks
                ``label``, ``ratio`` or ``target``.

        Example:
            >>> ratio = {"label": "x / y", "ratio": 1.2, "target": 1.5}
            >>> result = BenchmarkResult.from_document(
            ...     {"benchmark": "b", "machine": "m", "ratios": [ratio]}
            ... )
            >>> result.cpu, result.ratios[0]["met"], result.ratios[0]["q1"]
            ('m', True, 1.2)
            >>> result.ratios[0]["verdict"]
            'met'

        """
        if not isinstance(document, Mapping):
            raise ValueError(f"{source}: expected a JSON object, got {type(document).__name__}")
        missing = [key for key in ("benchmark", "ratios") if key not in document]
        if missing:
            raise ValueError(f"{source}: a benchmark result needs the fields {missing}; it has {sorted(document)}")
        ratios = []
        for row in document["ratios"]:
            lacking = [key for key in _RATIO_FIELDS if key not in row]
            if lacking:
                raise ValueError(f"{source}: a ratio needs the fields {lacking}; it has {sorted(row)}")
            row = dict(row)
            row.setdefault("q1", row["ratio"])
            row.setdefault("q3", row["ratio"])
            row["met"] = bool(row["ratio"] <= row["target"])
            if row["q3"] <= row["target"]:
                row["verdict"] = "met"
            elif row["q1"] > row["target"]:
                row["verdict"] = "missed"
            else:
                row["verdict"] = "not resolved"
            ratios.append(row)
        return cls(
            benchmark=str(document["benchmark"]),
            cpu=_cpu_name(document),
            ratios=tuple(ratios),
            document=dict(document),
            source=source,
            onednn=_onednn(document),
            vector=_vector(document),
        )


def short_cpu_name(model: str) -> str:
    """A CPU model name without trademark signs and a trailing "Processor", "CPU" or
    "CPU @ <clock>".

    Example:
        >>> short_cpu_name("Intel(R) Xeon(R) Processor")
        'Intel Xeon'
    """
    name = re.sub(r"\((R|TM|tm)\)", "", model)
    name = re.sub(r"\s+(Processor|CPU( @ .*)?)$", "", " ".join(name.split()))
    return name or model.strip()


def _cpu_name(document: Mapping[str, Any]) -> str:
    """The CPU model recorded in ``document``, under any of the names it may have."""
    for key in ("cpu_model", "cpu"):
        value = document.get(key)
        if isinstance(value, Mapping):
            value = value.get("model") or value.get("name")
        if isinstance(value, str) and value.strip():
            return short_cpu_name(value)
    return str(document.get("machine", "unknown machine"))


#: CPU flags (as /proc/cpuinfo spells them), widest first, and how a setting names them.
_VECTOR_NAMES = (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"))


def _vector(document: Mapping[str, Any]) -> str | None:
    """The widest vector extension in the recorded ``cpu.flags``, or None."""
    cpu = document.get("cpu")
    flags = cpu.get("flags") if isinstance(cpu, Mapping) else None
    if not isinstance(flags, (list, tuple)):
        return None
    return next((name for flag, name in _VECTOR_NAMES if flag in flags), None)


def _onednn(document: Mapping[str, Any]) -> bool | None:
    """Whether oneDNN was on, from ``onednn.enabled`` (or a bare boolean ``onednn``)."""
    value = document.get("onednn")
    if isinstance(value, Mapping):
        value = value.get("enabled")
    return value if isinstance(value, bool) else None


def results_directory() -> pathlib.Path:
    """The folder that holds the shipped results (the benchmarks write into it).

    Returns:
        The path of this package's folder.

    Example:
        >>> from companion.book.benchmark_results import results_directory
        >>> results_directory().name
        'benchmark_results'
    """
    return pathlib.Path(__file__).resolve().parent


def load_results(
    benchmark: str | None = None, directory: str | os.PathLike | None = None
) -> list[BenchmarkResult]:
    """Read the benchmark results: every file, or every file of one benchmark.

    Derived and shown in the chapter "What the fixes cost" (``book/tools/performance``).

    Args:
        benchmark: only this benchmark's results (e.g. ``"tilted_mean"``); ``None``: all.
        directory: read this folder instead of the results shipped with the package.

    Returns:
        The results, one per file (a benchmark has one file per CPU type and oneDNN
        setting measured), sorted by benchmark, then CPU, then oneDNN setting.

    Raises:
        TypeError: if ``benchmark`` is neither ``None`` nor a string.
        FileNotFoundError: if there is no result file at all (say where to make them).
        ValueError: if a file is not a benchmark result, or no file is of ``benchmark``.

    Example:
        >>> from companion.book.benchmark_results import load_results
        >>> [result.benchmark for result in load_results("tilted_mean")][:1]
        ['tilted_mean']
    """
    if benchmark is not None and not isinstance(benchmark, str):
        raise TypeError(f"benchmark must be a string or None, got {type(benchmark).__name__} {benchmark!r}")
    if directory is None:
        folder = importlib.resources.files(__name__)
        where = str(results_directory())
    else:
        folder = pathlib.Path(directory)
        where = str(folder)
    files = sorted(
        (entry for entry in folder.iterdir() if entry.name.endswith(".json") and entry.is_file()),
        key=lambda entry: entry.name,
    ) if folder.is_dir() else []
    if not files:
        raise FileNotFoundError(
            f"no benchmark results (*.json) in {where}: run the scripts of the repository's benchmarks/ "
            "folder with --json NAME.json, e.g. `python benchmarks/tilted_mean.py --json tilted_mean.json`"
        )
    results = []
    for entry in files:
        try:
            document = json.loads(entry.read_text(encoding="utf-8"))
        except json.JSONDecodeError as error:
            raise ValueError(f"{entry.name}: not valid JSON ({error})") from error
        results.append(BenchmarkResult.from_document(document, source=entry.name))
    if benchmark is not None:
        known = sorted({result.benchmark for result in results})
        results = [result for result in results if result.benchmark == benchmark]
        if not results:
            raise ValueError(f"no results of the benchmark {benchmark!r}; there are results of {known}")
    return sorted(results, key=lambda result: (result.benchmark, result.setting, result.source))
