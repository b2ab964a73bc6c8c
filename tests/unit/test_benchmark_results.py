"""companion.book.benchmark_results: the benchmark results ship with the package and read anywhere."""

from __future__ import annotations

import doctest
import importlib.util
import json
import pathlib
import sys

import pytest

import companion.book.benchmark_results as benchmark_results
from companion.book.benchmark_results import BenchmarkResult, load_results, results_directory

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _document(benchmark="tilted_mean", ratio=1.2, target=1.5, **fields) -> dict:
    return {
        "benchmark": benchmark,
        "machine": "2 CPU cores (x86_64), no GPU",
        "ratios": [{"label": f"{benchmark} / naive", "ratio": ratio, "target": target, "q1": 1.1, "q3": 1.3}],
        **fields,
    }


def _write(folder: pathlib.Path, name: str, document) -> None:
    (folder / name).write_text(json.dumps(document))


def test_the_installed_package_ships_a_result_of_each_benchmark():
    results = load_results()
    assert {result.benchmark for result in results} >= {"tilted_mean", "training_overhead"}
    assert all(path.suffix == ".json" for path in results_directory().iterdir() if path.is_file()
               and not path.name.startswith("__"))
    for result in results:
        assert result.ratios, f"{result.source} has no ratio"
        for row in result.ratios:
            assert row["met"] == (row["ratio"] <= row["target"])
            assert row["q1"] <= row["ratio"] <= row["q3"], f"{result.source}: {row}"


def test_load_results_of_one_benchmark_returns_only_that_benchmark():
    results = load_results("tilted_mean")
    assert results and {result.benchmark for result in results} == {"tilted_mean"}


def test_every_cpu_type_of_a_benchmark_is_a_result_of_its_own_sorted_by_cpu(tmp_path):
    _write(tmp_path, "tilted_mean.json", _document(ratio=1.17))
    _write(tmp_path, "tilted_mean-epyc.json", _document(ratio=1.52, cpu_model="AMD EPYC 9B14"))
    _write(tmp_path, "training_overhead.json", _document("training_overhead", ratio=0.25, target=0.5))
    results = load_results("tilted_mean", directory=tmp_path)
    assert [(result.cpu, result.ratios[0]["ratio"], result.ratios[0]["met"]) for result in results] == [
        ("2 CPU cores (x86_64), no GPU", 1.17, True),
        ("AMD EPYC 9B14", 1.52, False),
    ]
    assert [result.benchmark for result in load_results(directory=tmp_path)] == [
        "tilted_mean", "tilted_mean", "training_overhead"
    ]


@pytest.mark.parametrize(
    "fields, cpu",
    [
        ({"cpu_model": "Intel Xeon"}, "Intel Xeon"),
        ({"cpu": "Intel Xeon"}, "Intel Xeon"),
        ({"cpu": {"model": "AMD EPYC", "flags": ["avx512f"]}}, "AMD EPYC"),
        ({"cpu": {"name": "AMD EPYC"}}, "AMD EPYC"),
        ({"cpu": ""}, "2 CPU cores (x86_64), no GPU"),
    ],
)
def test_the_cpu_is_the_recorded_model_else_the_machine(fields, cpu):
    assert BenchmarkResult.from_document(_document(**fields)).cpu == cpu


def test_fields_the_reader_does_not_know_are_kept():
    document = _document(onednn=True, stack={"python": "3.13"})
    document["ratios"][0]["fastest"] = 1.0
    result = BenchmarkResult.from_document(document)
    assert result.document["onednn"] is True and result.document["stack"] == {"python": "3.13"}
    assert result.ratios[0]["fastest"] == 1.0


def test_quartiles_default_to_the_ratio_and_met_is_recomputed():
    document = _document(ratio=2.0, target=1.5)
    document["ratios"][0] = {"label": "x", "ratio": 2.0, "target": 1.5, "met": True}
    row = BenchmarkResult.from_document(document).ratios[0]
    assert (row["q1"], row["q3"], row["met"]) == (2.0, 2.0, False)


@pytest.mark.parametrize("make", [lambda tmp: tmp, lambda tmp: tmp / "missing"])
def test_no_results_is_a_clear_file_not_found_error(tmp_path, make):
    (tmp_path / "notes.txt").write_text("not a result")
    with pytest.raises(FileNotFoundError, match=r"no benchmark results \(\*\.json\) in .*--json"):
        load_results(directory=make(tmp_path))


def test_an_unknown_benchmark_is_a_value_error_naming_the_known_ones(tmp_path):
    _write(tmp_path, "a.json", _document())
    with pytest.raises(ValueError, match=r"'tilted_men'.*\['tilted_mean'\]"):
        load_results("tilted_men", directory=tmp_path)


def test_a_benchmark_that_is_not_a_string_is_a_type_error():
    with pytest.raises(TypeError, match="benchmark must be a string or None, got int 3"):
        load_results(3)


@pytest.mark.parametrize(
    "document, message",
    [
        ([1, 2], "expected a JSON object, got list"),
        ({"benchmark": "b"}, r"needs the fields \['ratios'\]"),
        ({"benchmark": "b", "ratios": [{"label": "x", "ratio": 1.0}]}, r"needs the fields \['target'\]"),
    ],
)
def test_a_file_that_is_not_a_result_is_a_value_error_naming_it(tmp_path, document, message):
    _write(tmp_path, "bad.json", document)
    with pytest.raises(ValueError, match=f"bad.json: .*{message}"):
        load_results(directory=tmp_path)


def test_invalid_json_is_a_value_error_naming_the_file(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_results(directory=tmp_path)


def test_the_docstring_examples_run():
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    tests = [test for test in finder.find(benchmark_results) if test.examples]
    assert len(tests) == 5  # from_document, setting, load_results, results_directory, short_cpu_name
    for test in tests:
        runner.run(test)
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.skipif(not (ROOT / "benchmarks" / "_results.py").is_file(), reason="needs the repository")
def test_a_benchmark_writes_a_bare_file_name_into_the_results_the_package_ships(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("_benchmark_results_writer", ROOT / "benchmarks" / "_results.py")
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    assert writer.RESULTS == ROOT / "companion" / "book" / "benchmark_results"
    monkeypatch.setattr(writer, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", ["benchmarks/tilted_mean.py", "--json", "tilted_mean.json"])
    writer.write_results("tilted_mean.json", "tilted_mean", [{"label": "x", "ratio": 1.6, "target": 1.5}])
    (result,) = load_results(directory=tmp_path)
    assert (result.benchmark, result.ratios[0]["met"]) == ("tilted_mean", False)
    assert result.document["tensorflow"] and result.document["keras"]


@pytest.mark.parametrize(
    "onednn, setting",
    [({"TF_ENABLE_ONEDNN_OPTS": "0", "enabled": False}, "AMD EPYC, oneDNN off"),
     ({"enabled": True}, "AMD EPYC, oneDNN on"), (True, "AMD EPYC, oneDNN on"),
     (None, "AMD EPYC, oneDNN not recorded"), ({"enabled": None}, "AMD EPYC, oneDNN not recorded")],
)
def test_the_setting_names_the_cpu_and_the_onednn_state(onednn, setting):
    fields = {"cpu": "AMD EPYC"} if onednn is None else {"cpu": "AMD EPYC", "onednn": onednn}
    assert BenchmarkResult.from_document(_document(**fields)).setting == setting


def test_two_files_of_one_cpu_with_different_onednn_settings_have_different_settings(tmp_path):
    # The performance chapter labels each table with the setting: two files of one CPU
    # must not show the same label with different numbers.
    for enabled in (False, True):
        _write(tmp_path, f"t-{enabled}.json", _document(cpu="AMD EPYC", onednn={"enabled": enabled}))
    settings = [result.setting for result in load_results(directory=tmp_path)]
    assert settings == ["AMD EPYC, oneDNN off", "AMD EPYC, oneDNN on"]
    shipped = [(result.benchmark, result.setting) for result in load_results()]
    assert len(shipped) == len(set(shipped)), shipped


@pytest.mark.parametrize(
    "q1, q3, verdict",
    [(0.9, 1.02, "met"), (1.0, 1.03, "met"), (0.84, 1.23, "not resolved"), (1.031, 1.2, "missed")],
)
def test_the_verdict_says_whether_the_spread_of_the_rounds_resolves_the_target(q1, q3, verdict):
    document = _document(ratio=1.0 if q1 <= 1.0 else q1, target=1.03)
    document["ratios"][0].update(q1=q1, q3=q3)
    row = BenchmarkResult.from_document(document).ratios[0]
    assert row["verdict"] == verdict


def test_a_cpu_model_name_loses_its_trademark_signs_and_a_trailing_processor():
    assert benchmark_results.short_cpu_name("Intel(R) Xeon(R) Processor") == "Intel Xeon"
    assert benchmark_results.short_cpu_name("Intel(R) Xeon(R) Platinum 8488C CPU @ 2.40GHz") == "Intel Xeon Platinum 8488C"
    assert benchmark_results.short_cpu_name("Intel(R) Core(TM) i7-8700 CPU") == "Intel Core i7-8700"
    assert benchmark_results.short_cpu_name("AMD EPYC 7B13 64-Core Processor") == "AMD EPYC 7B13 64-Core"
    assert benchmark_results.short_cpu_name("AMD EPYC") == "AMD EPYC"
    # What the performance page shows of a file that recorded the long name.
    result = benchmark_results.BenchmarkResult.from_document({
        "benchmark": "b", "cpu": {"model": "Intel(R) Xeon(R) Processor", "flags": ["avx512f"]},
        "onednn": {"enabled": True}, "ratios": []})
    assert result.setting == "Intel Xeon AVX-512, oneDNN on"
