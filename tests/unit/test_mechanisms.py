"""The checklist's recurring mechanisms (issue 42, item 8): each example fails as its section says, its fix cures it.

Also: the survey behind the checklist has at least 250 public reports, and every pattern
added with these sections recurs in it and has a section in the checklist; the four
rebuilt reports of *Finding your own NaN* (companion.book.field) are diagnosed and cured.
"""

from __future__ import annotations

import json
import pathlib
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from companion.book import mechanisms as m
from companion.book.cases import first_nonfinite
from companion.book.field import FIELD_REPORTS, field_rebuild
from companion.book.survey import PATTERNS, load_reports
from companion.diagnostics import CAUSES, diagnose
from companion.training import train

ROOT = pathlib.Path(__file__).resolve().parents[2]

#: The patterns item 8 asks a section for, and the heading of the checklist's section.
SECTIONS = {
    "init_log_prior": "Weights that are not finite before the first step",
    "data_dependent_init": "Weights that are not finite before the first step",
    "lr_schedule": "A learning-rate schedule that goes below zero",
    "bootstrapped_targets": "Targets bootstrapped from the model itself",
    "class_count_weights": "Weights computed from class counts",
    "special_function_overflow": "Special functions that overflow",
    "cholesky_float32": "Cholesky of a matrix `float32` cannot keep positive definite",
    "sampler_endpoint": "Samplers that return the end of their interval",
}


def _checklist_headings() -> set[str]:
    cells = json.loads((ROOT / "book/closing/checklist.ipynb").read_text())["cells"]
    text = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return {m.group(1).strip() for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def test_the_survey_has_at_least_250_reports_each_cited_and_classified():
    reports = load_reports()
    assert len(reports) >= 250
    for report in reports:
        assert report.url.startswith(("https://", "http://")), report.url
        assert report.pattern in PATTERNS and (report.cause in CAUSES or report.cause == "unresolved")


@pytest.mark.parametrize("pattern", sorted(SECTIONS))
def test_each_mechanism_recurs_in_the_survey_and_has_a_checklist_section(pattern):
    assert sum(r.pattern == pattern for r in load_reports()) >= 2
    assert SECTIONS[pattern] in _checklist_headings()


def _tagger(floor=None):
    return m.label_tagger(floor=floor)


def test_a_log_prior_bias_of_a_zero_frequency_is_named_at_its_initializer_and_a_floor_cures_it():
    model, x, y = _tagger()
    d = diagnose(model, (x, y))
    assert (d.cause, d.phase, d.variables) == ("nonfinite_init", "weights", ("tagger/labels/bias",)), str(d)
    assert d.source.endswith("mechanisms.py:" + str(_line_of(m.__file__, "# prior")))
    with pytest.raises(ValueError, match="tagger/labels/bias"):
        train(model, x, y, epochs=1, verbose=0)
    model, x, y = _tagger(floor=1e-7)
    history = model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    assert np.isfinite(history.history["loss"]).all()


def _line_of(filename: str, marker: str) -> int:
    lines = open(filename).read().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.rstrip().endswith(marker))


def test_a_data_dependent_scale_over_a_constant_feature_is_infinite_and_divide_no_nan_cures_it():
    x = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
    x[:, 1] = 0.5
    for safe in (False, True):
        layer = m.DataInitScale()
        layer.build((None, 3))
        layer.initialize(x, safe=safe)
        assert bool(np.isfinite(layer(x).numpy()).all()) == safe


def test_a_linear_schedule_past_its_end_turns_negative_and_diverges_a_floored_one_does_not():
    losses, rates = m.scheduled_fit(m.LinearDecay(0.1, 40), steps=150)
    step = first_nonfinite(losses)
    assert step is not None and rates[step] < 0
    for schedule in (m.LinearDecay(0.1, 40, floor=0.0),
                     keras.optimizers.schedules.PolynomialDecay(0.1, 40, end_learning_rate=0.0)):
        losses, rates = m.scheduled_fit(schedule, steps=150)
        assert first_nonfinite(losses) is None and min(rates) >= 0


def test_bootstrapped_targets_off_policy_overflow_and_on_both_states_shrink():
    assert first_nonfinite(m.td_run(200)) is not None
    w = m.td_run(200, both_states=True)
    assert first_nonfinite(w) is None and abs(w[-1]) < 1e-6


def test_a_positive_weight_of_n_over_0_makes_the_loss_nan_and_divide_no_nan_does_not():
    labels = np.zeros((8, 2), np.float32)
    labels[:3, 0] = 1.0
    logits = tf.constant(np.random.default_rng(0).normal(size=(8, 2)).astype("float32"))
    assert np.isinf(m.positive_weight(labels).numpy()[1])
    assert not np.isfinite(m.weighted_loss(labels, logits, m.positive_weight(labels)))
    assert np.isfinite(m.weighted_loss(labels, logits, m.positive_weight(labels, safe=True)))


def test_log_bessel_i0_and_log_beta_overflow_as_written_and_not_in_the_log_domain():
    kappa = tf.constant(100.0)
    for stable in (False, True):
        with tf.GradientTape() as tape:
            tape.watch(kappa)
            value = m.log_bessel_i0(kappa, stable=stable)
        finite = np.isfinite(value.numpy()) and np.isfinite(tape.gradient(value, kappa).numpy())
        assert bool(finite) == stable
    # log I0(100) = 100 + log(1 / sqrt(200 pi)) + O(1/k): 96.78
    assert abs(float(m.log_bessel_i0(kappa, stable=True)) - 96.7797) < 1e-3
    assert np.isnan(m.log_beta(40.0, 40.0)) and np.isfinite(m.log_beta(40.0, 40.0, stable=True))


def test_a_float32_kernel_matrix_needs_a_jitter_for_its_cholesky():
    exact = np.linalg.eigvalsh(m.rbf_kernel(40, dtype=tf.float64).numpy())
    assert exact.min() / exact.max() < np.finfo(np.float32).eps
    assert not np.isfinite(m.cholesky(m.rbf_kernel(40)).numpy()).all()
    assert np.isfinite(m.cholesky(m.rbf_kernel(40), jitter=1e-4).numpy()).all()


def test_beta_draws_reach_1_and_the_logs_from_the_gamma_draws_stay_finite():
    draws = m.beta_draws(1000, concentration=0.1)
    assert np.any(draws["x"].numpy() == 1.0)
    assert not np.isfinite(draws["log1m_naive"].numpy()).all()
    assert np.isfinite(draws["log1m_safe"].numpy()).all()


@pytest.mark.parametrize("key", sorted(FIELD_REPORTS))
def test_each_field_report_is_in_the_survey_diagnosed_and_cured_by_its_first_remedy(key):
    assert FIELD_REPORTS[key][1] in {r.url for r in load_reports()}
    r = field_rebuild(key)
    d = diagnose(r.model, r.data, batch_size=r.batch_size) if r.batch_size else diagnose(r.model, r.data)
    expected = {"ethogram": "nonfinite_init", "speech_commands": "nonfinite_input",
                "min_snr_diffusion": "division_by_zero", "wgan_critic": "overflow"}[key]
    assert d is not None and d.cause == expected, str(d)
    assert d.source and "field.py" in d.source and d.verified.startswith("verified:"), str(d)
    assert keras.mixed_precision.global_policy().name == "float32"
    assert np.isfinite(field_rebuild(key, fixed=True).fit(epochs=1)).all()


def test_a_standardisation_in_a_tf_data_map_is_named_at_its_division_and_divide_no_nan_cures_it():
    model, data = m.standardized_dataset()
    d = diagnose(model, data)
    assert (d.cause, d.phase, d.op) == ("nonfinite_input", "input", "RealDiv"), str(d)
    assert d.source.endswith("mechanisms.py:" + str(_line_of(m.__file__, "# standardize")))
    assert "divide_no_nan" in d.remedy and d.verified.startswith("verified:")
    model, data = m.standardized_dataset(safe=True)
    assert np.isfinite(model.fit(data, epochs=2, shuffle=False, verbose=0).history["loss"]).all()


def _adam(epsilon=1e-8):
    return keras.optimizers.Adam(1e-3, epsilon=epsilon)


def test_adams_float16_epsilon_of_0_makes_the_update_nan_and_an_epsilon_float16_holds_cures_it():
    d = m.half_precision_diagnosis()
    assert (d.cause, d.phase, d.variables[0]) == ("nonfinite_update", "update", "half/head/kernel"), str(d)
    assert d.source.endswith("mechanisms.py:" + str(_line_of(m.__file__, 'epsilon=1e-8), "mse")'))), d.source
    assert d.remedy.startswith("keras.optimizers.Adam(epsilon=0.0001)") and d.verified.startswith("verified:")
    model, x, y = m.half_precision_regression()
    step = m.update_steps(model, x, y, steps=1)[0]
    assert np.isfinite(step["loss"]) and step["gradients finite"] and not step["weights finite"]
    cures = {"epsilon": (_adam(1e-4), "float16"), "mixed": (_adam(), "mixed_float16")}
    for name, (optimizer, dtype) in cures.items():
        model, x, y = m.half_precision_regression(optimizer, dtype=dtype)
        steps = m.update_steps(model, x, y, steps=20)
        assert all(s["weights finite"] for s in steps), name
        assert steps[-1]["loss"] < steps[0]["loss"], name  # it trains, not only stays finite
    assert model.trainable_variables[0].dtype == "float32"  # mixed_float16 keeps the variables so
