"""The NaN doctor on the public reports that *Finding your own NaN* rebuilds (companion.book.reports).

Each rebuild is run the way its reporter ran it (``model.fit`` with the NaNDoctor
callback, an eager loop, a ``tf.function`` loop, XLA); the doctor must name the cause,
the layer and the line of the report's mechanism, and the fixed rebuild must train with
finite weights.
"""

import functools

import numpy as np
import pytest

from companion.book import reports
from companion.diagnostics import CAUSES, NaNDoctor, diagnose
from companion.book.reports import REPORTS, rebuild, run_as_reported

# key -> (batch, phase, layer, text of the source line the doctor must show)
EXPECTED = {
    "angular_distance": (0, "backward", "angular_distance", "tf.math.acos"),
    "triplet_loss": (0, "backward", None, "tf.norm(u - v, axis=1)"),
    "complex_angle": (0, "backward", None, "tf.math.angle(z)"),
    "where_activation": (0, "backward", "transfer", "1.0 / (1.0 - z)"),
    "std_of_zero_vector": (0, "backward", "stats_pool", "keras.ops.std"),
    "probabilities_crossentropy": (0, "loss", None, "tf.math.log(y_pred)"),
    "learning_rate": (38, "loss", None, None),
    "multi_output_kl": (0, "loss", None, "tf.math.log(y_true / y_pred)"),
    "std_batch_of_one": (1, "backward", "batch_scale", "tf.math.reduce_std"),
    "nan_in_data": (2, "input", None, None),
}


@functools.cache  # the same diagnosis for every test that reads it (each takes a rebuild and a run)
def _diagnosis(key):
    r = rebuild(key)
    if REPORTS[key].mode.startswith("fit"):
        doctor = NaNDoctor(verbose=False)
        run_as_reported(r, callbacks=[doctor])
        return doctor.diagnosis
    return diagnose(r.model, r.data, loss=r.loss)


def test_reports_cover_fit_xla_loops_multi_output_and_complex():
    modes = {info.mode for info in REPORTS.values()}
    assert {"fit", "fit, XLA", "eager loop", "tf.function loop"} <= modes
    assert len(REPORTS) >= 8
    assert all(info.url.startswith("https://") for info in REPORTS.values())
    assert all(info.cause in CAUSES for info in REPORTS.values())
    outputs = rebuild("multi_output_kl").model.outputs
    assert len(outputs) == 2


def test_every_report_is_in_the_survey():
    from companion.book.survey import load_reports

    urls = {r.url for r in load_reports()}
    for key, info in REPORTS.items():
        assert info.url in urls, key


@pytest.mark.parametrize("key", list(REPORTS))
def test_run_as_reported_fails(key):
    r = rebuild(key)
    run = run_as_reported(r)
    assert not (run["weights_finite"] and all(np.isfinite(run["losses"]))), run


@pytest.mark.parametrize("key", list(REPORTS))
def test_doctor_names_cause_batch_phase_layer_and_line(key):
    diagnosis = _diagnosis(key)
    assert diagnosis is not None, key
    batch, phase, layer, code = EXPECTED[key]
    assert diagnosis.cause == REPORTS[key].cause
    assert diagnosis.batch == batch
    assert diagnosis.phase == phase
    if layer is not None:
        assert diagnosis.layer is not None and diagnosis.layer.split("/")[-1] == layer
    if code is not None:
        assert diagnosis.source and diagnosis.source.split(":")[0].endswith("reports.py")
        assert code in (diagnosis.code or ""), diagnosis.code
    assert all(len(line) <= 80 for line in str(diagnosis).splitlines())


def test_xla_case_is_compiled_with_xla_and_found_in_the_compiled_step():
    assert rebuild("probabilities_crossentropy").model.jit_compile is True
    diagnosis = _diagnosis("probabilities_crossentropy")
    assert diagnosis.mode_disagreement is None, "XLA and the op-by-op run agree: both non-finite"


def test_complex_case_sees_the_complex_angle():
    diagnosis = _diagnosis("complex_angle")
    assert diagnosis.forward_op == "Angle"


@pytest.mark.parametrize("key", list(REPORTS))
def test_fixed_rebuild_trains_with_finite_weights_and_loss(key):
    run = run_as_reported(rebuild(key, fixed=True))
    assert run["weights_finite"]
    assert all(np.isfinite(run["losses"]))


@pytest.mark.parametrize("key", list(REPORTS))
def test_doctor_finds_nothing_in_the_fixed_rebuild(key):
    r = rebuild(key, fixed=True)
    assert diagnose(r.model, r.data, loss=r.loss) is None


def test_rebuild_rejects_an_unknown_key():
    with pytest.raises(KeyError, match="unknown report"):
        reports.rebuild("nonsense")


def test_the_chapter_cites_every_rebuilt_report_and_is_in_the_toc():
    import json
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    notebook = json.loads((root / "book/closing/finding_your_own_nan.ipynb").read_text())
    text = "".join("".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "markdown")
    for key, info in REPORTS.items():
        assert info.url in text, key
    toc = (root / "_toc.yml").read_text()
    assert toc.index("book/closing/checklist") < toc.index("book/closing/finding_your_own_nan")
