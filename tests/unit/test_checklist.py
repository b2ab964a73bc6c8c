"""The checklist's survey and cases (companion.book.survey, .cases), as its chapter shows them.

Each case asserts what its row of the chapter shows: the naive form is not finite at its
point (value or gradient), the fix is finite in both, and where the naive value is finite
the fix has the same value.
"""

import math
import re

import numpy as np
import pytest
import tensorflow as tf

from companion.book import cases
from companion.book.cases import CASES, check_case
from companion.book.survey import PATTERNS, cause_counts, load_reports, pattern_counts
from companion.diagnostics import CAUSES

#: The causes a survey report or a checklist case can have: the doctor's, except the two
#: that describe a diagnosis rather than a NaN (a report whose cause was never found is
#: "unresolved"; one that does not reproduce is not a row of the checklist).
DOCTOR_CAUSES = set(CAUSES) - {"unclassified", "not_reproducible"}


@pytest.fixture(scope="module")
def reports():
    return load_reports()


def test_survey_has_at_least_150_distinct_public_reports_each_with_a_url(reports):
    assert len(reports) >= 150
    assert len({r.url for r in reports}) == len(reports)
    for report in reports:
        assert re.match(r"https?://[\w.-]+/\S+$", report.url), report.url
        assert report.kind in {"issue", "qa", "forum", "blog"}
        assert report.basis in {"stated", "inferred", "none"}


def test_survey_is_mostly_tensorflow_and_keras_reports(reports):
    tf_keras = [r for r in reports if r.framework in ("tensorflow", "keras")]
    assert len(tf_keras) >= 30


def test_every_survey_cause_is_a_doctor_cause_or_says_why_not(reports):
    for report in reports:
        assert report.cause in DOCTOR_CAUSES | {"unresolved"}, report
        assert (report.cause == "unresolved") == (report.basis == "none"), report


def test_survey_covers_every_row_the_issue_asks_for(reports):
    patterns = {r.pattern for r in reports}
    for wanted in [
        "acos_asin",
        "atan2_angle",
        "crossentropy_probabilities",
        "zero_variance_norm",
        "reduce_std",
        "cosine_zero_vector",
        "learning_rate",
        "softplus_logsigmoid",
        "where_trap",
        "pow_negative_base",
        "float16_range",
        "label_out_of_range",
    ]:
        assert wanted in patterns, wanted


@pytest.mark.parametrize("pattern", ["log_at_zero", "sqrt_of_negative", "exp_overflow", "single_sample_variance"])
def test_each_recurring_pattern_added_with_the_survey_has_reports_and_a_case(reports, pattern):
    assert pattern in PATTERNS
    assert sum(r.pattern == pattern for r in reports) >= 3, "a row of the checklist is for a recurring cause"
    assert [case.pattern for case in CASES.values()].count(pattern) == 1


def test_a_label_outside_the_classes_raises_on_cpu_where_the_gpu_returns_nan():
    # The label_out_of_range reports: on GPU the op returns NaN for such a label; on CPU
    # it raises, which is how the checklist's table finds it.
    with tf.device("/CPU:0"), pytest.raises(tf.errors.InvalidArgumentError, match=r"\[0, 2\)"):
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=[2], logits=[[0.0, 1.0]])
    fine = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=[1], logits=[[0.0, 1.0]])
    assert np.isfinite(fine.numpy()).all()


def test_cause_counts_add_up_and_are_sorted(reports):
    counts = cause_counts(reports)
    assert sum(n for _, n in counts) == len(reports)
    assert [n for _, n in counts] == sorted((n for _, n in counts), reverse=True)
    tf_counts = dict(cause_counts(reports, frameworks=("tensorflow", "keras")))
    assert sum(tf_counts.values()) == sum(r.framework in ("tensorflow", "keras") for r in reports)


def test_pattern_counts_agree_with_cause_counts(reports):
    by_cause = {}
    for _, cause, n in pattern_counts(reports):
        by_cause[cause] = by_cause.get(cause, 0) + n
    assert by_cause == dict(cause_counts(reports))


def test_load_reports_rejects_an_unknown_pattern_a_wrong_field_count_and_a_duplicate(tmp_path):
    header = "url,framework,kind,pattern,cause,basis,summary\n"
    bad = tmp_path / "bad.csv"
    bad.write_text(header + "https://x.org/1,tensorflow,issue,nonsense,overflow,stated,s\n")
    with pytest.raises(ValueError, match="unknown pattern"):
        load_reports(bad)
    comma = tmp_path / "comma.csv"
    comma.write_text(header + "https://x.org/1,tensorflow,issue,data,nonfinite_input,stated,a, b\n")
    with pytest.raises(ValueError, match="line 2 has 8 fields"):
        load_reports(comma)
    short = tmp_path / "short.csv"
    short.write_text(header + "https://x.org/1,tensorflow,issue,data,nonfinite_input,stated\n")
    with pytest.raises(ValueError, match="line 2 has 6 fields; expected 7"):
        load_reports(short)
    twice = tmp_path / "twice.csv"
    row = "https://x.org/1,tensorflow,issue,data,nonfinite_input,stated,s\n"
    twice.write_text(header + row + row)
    with pytest.raises(ValueError, match="twice"):
        load_reports(twice)


def test_cases_cover_the_rows_the_issue_asks_for():
    patterns = {case.pattern for case in CASES.values()}
    for wanted in [
        "acos_asin",
        "atan2_angle",
        "crossentropy_probabilities",
        "zero_variance_norm",
        "reduce_std",
        "cosine_zero_vector",
        "softplus_logsigmoid",
        "where_trap",
        "pow_negative_base",
    ]:
        assert wanted in patterns, wanted
    for case in CASES.values():
        assert case.pattern in PATTERNS
        assert case.cause in DOCTOR_CAUSES


@pytest.mark.parametrize("name", list(CASES))
def test_naive_form_is_not_finite_and_the_fix_is(name):
    result = check_case(CASES[name])
    assert not (result.value and result.gradient), f"{name}: the naive form is finite, {result}"
    assert result.fixed_value and result.fixed_gradient, f"{name}: the fix is not finite, {result}"


@pytest.mark.parametrize("name", [n for n in CASES if check_case(CASES[n]).value])
def test_fix_keeps_the_naive_value_where_that_is_finite(name):
    case = CASES[name]
    point = tf.constant(case.point, dtype=case.dtype)
    naive = float(tf.cast(case.naive(point), tf.float32))
    fixed = float(tf.cast(case.fix(point), tf.float32))
    # Clipping into the open interval moves acos(1) by acos(1 - eps) = sqrt(2 eps) = 5e-4.
    tolerance = 1e-3 if case.pattern == "acos_asin" else 1e-6
    assert fixed == pytest.approx(naive, rel=1e-3, abs=tolerance), name


@pytest.mark.parametrize("name", list(CASES))
def test_fix_agrees_with_the_naive_form_away_from_the_bad_point(name):
    case = CASES[name]
    if case.dtype == "float16" or name.startswith(("logsumexp", "softmax", "cross", "log(")):
        point = np.array(case.point, np.float32) / 25.0  # moderate scores: no overflow
    else:
        point = np.array(case.point, np.float32) * 0.5 + np.linspace(0.1, 0.3, len(case.point)).astype(np.float32)
    if name.startswith("(-8)"):
        point = np.array([8.0], np.float32)
    if case.pattern == "zero_variance_norm":
        point = np.array([1.0, 4.0, 10.0], np.float32)  # variance 14: the epsilon 1e-3 is lost in it
    if case.pattern == "sqrt_of_negative":
        point = np.abs(point)  # the shifted point is still negative
    if case.pattern == "single_sample_variance":
        point = np.array([1.0, 4.0, 10.0], np.float32)  # three samples: n - 1 = 2
    x = tf.constant(point)
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(x)
        naive, fixed = case.naive(x), case.fix(x)
    np.testing.assert_allclose(fixed.numpy(), naive.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(tape.gradient(fixed, x).numpy(), tape.gradient(naive, x).numpy(), rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("name", list(CASES))
def test_the_doctor_names_each_cases_cause_and_layer(name):
    case = CASES[name]
    diagnosis = cases.doctor_run(case)
    assert diagnosis is not None
    assert diagnosis.cause == case.cause
    assert diagnosis.layer == f"case/{case.pattern}"
    if not check_case(case).gradient:
        assert diagnosis.variables, "the identity Dense layer's variables get non-finite gradients"


def test_toy_model_has_a_nan_gradient_at_zero_and_is_the_square_root():
    model = cases.toy_model()
    x = np.array([[0.0], [4.0]], np.float32)
    np.testing.assert_array_equal(model(x).numpy(), [[0.0], [2.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - np.sqrt(x)))
    gradients = tape.gradient(loss, model.trainable_variables)
    assert not any(np.isfinite(g.numpy()).all() for g in gradients)


def test_large_learning_rate_diverges_to_nonfinite_and_small_one_converges():
    large = cases.diverging_fit(0.15, steps=60)
    assert cases.first_nonfinite(large) is not None
    finite_part = large[: cases.first_nonfinite(large) - 1]
    assert all(b > a for a, b in zip(finite_part, finite_part[1:])), "the loss grows every step until it overflows"
    small = cases.diverging_fit(0.05, steps=40)
    assert cases.first_nonfinite(small) is None and small[-1] < 1e-3 * small[0]
    clipped = cases.diverging_fit(0.15, steps=60, clipnorm=1.0)
    assert cases.first_nonfinite(clipped) is None


def test_fixed_loss_scale_overflows_float16_and_dynamic_scale_recovers():
    fixed = cases.loss_scaling_run(dynamic=False, steps=2)
    assert fixed["weights_finite"] == [False, False]
    dynamic = cases.loss_scaling_run(dynamic=True, steps=12)
    assert all(dynamic["weights_finite"])
    assert dynamic["scale"][0] == 2.0**14, "the first step is skipped and the scale halved"
    assert dynamic["loss"][-1] < dynamic["loss"][0], "once the scale fits, it learns"
    skipped = sum(a == b for a, b in zip(dynamic["loss"], dynamic["loss"][1:]))
    assert 1 <= skipped < 11
    assert tf.keras.mixed_precision.global_policy().name == "float32", "the policy is restored"


def test_the_doctor_names_the_fixed_loss_scale_overflow():
    diagnosis = cases.fixed_loss_scale_diagnosis()
    assert (diagnosis.cause, diagnosis.phase, diagnosis.dtype) == ("overflow", "backward", "float16")
    assert "65504" in diagnosis.inputs_summary
    assert tf.keras.mixed_precision.global_policy().name == "float32"


def test_first_nonfinite():
    assert cases.first_nonfinite([1.0, 2.0]) is None
    assert cases.first_nonfinite([1.0, math.nan]) == 2
