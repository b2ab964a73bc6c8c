"""The remedy printed first is a verified one wherever one of the doctor's remedies verifies (issue 42).

For every case of the doctor's case tests (the rebuilt reports of ``test_doctor_reports``,
the remedies' cases of ``test_doctor_remedies``, and the causes read from the values of
``test_doctor_values_causes``), every remedy the doctor has for that diagnosis is checked
(:func:`companion.diagnostics.remedies.candidates` with ``every=True``: each applied to a
copy of the failing step, or of the steps up to it), and the rule is asserted: an
unverified remedy is never printed first where a verified one exists, and where none
verifies the first is printed with what its check found. Every cause of ``CAUSES`` is
covered by a case, or named below with the reason it has no remedy to order.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import test_doctor_remedies as remedy_cases
import test_doctor_reports as reports
import test_doctor_values_causes as values
from companion.diagnostics import CAUSES, NaNDoctor, diagnose
from companion.diagnostics import callback
from companion.diagnostics.remedies import candidates
from companion.diagnostics.scan import loss_function
from companion.diagnostics.step import uses_own_step

#: Causes no case here reaches, and why they have no list of remedies to order.
NOT_ORDERED = {
    "not_reproducible": "the step is finite when run again: there is nothing to cure on it",
    "unclassified": "no remedy: the doctor names no mechanism",
    "nonfinite_weights": "the cure is in an earlier step; its remedy (train) is the cause's fix, with no check",
    "nonfinite_init": "one remedy (the value made finite where it is set), checked in test_doctor_field",
    "nonfinite_update": "one remedy per case (an epsilon or float32 variables), checked in test_doctor_update_nan",
    "bootstrapped_targets": "one remedy (clipnorm), which one step cannot check: test_doctor_values_causes says so",
}

SEEN: set[str] = set()


def assert_first_is_verified_if_any(d, found) -> None:
    """The rule: the printed remedy is the first that verified, or, if none did, the first tried."""
    assert d is not None
    SEEN.add(d.cause)
    verified = [remedy for remedy, verdict in found if (verdict or "").startswith("verified")]
    listing = "\n".join(f"  {verdict}: {remedy}" for remedy, verdict in found)
    if verified:
        assert (d.verified or "").startswith("verified"), f"{d}\n\ncandidates:\n{listing}"
        assert d.remedy == verified[0], f"{d}\n\ncandidates:\n{listing}"
    else:
        assert not (d.verified or "").startswith("verified"), f"{d}\n\ncandidates:\n{listing}"
        if found and found[0][0] is not None:
            assert d.remedy == found[0][0], f"{d}\n\ncandidates:\n{listing}"
    if d.verified is not None:  # what was run and what came out
        assert " with " in d.verified or " without " in d.verified or "could not" in d.verified, d.verified


def every_remedy(d, model, loss=None, steps=None):
    """Every remedy the doctor has for ``d`` on its failing batch, each with its own check."""
    own = uses_own_step(model, loss)
    loss_fn = None if own else loss_function(model, loss)
    x, y, w = d._capsule["batch"]
    return candidates(d, model, loss_fn, x, y, w, steps, every=True)


@pytest.fixture
def checks(monkeypatch):
    """What NaNDoctor hands to verify (the failing batch and fit's steps), kept for the same re-run here."""
    kept = {}
    real = callback.verify

    def kept_verify(found, model, loss_fn, x, y, w, steps=None):
        kept.update(loss_fn=loss_fn, batch=(x, y, w), steps=steps)
        return real(found, model, loss_fn, x, y, w, steps=steps)

    monkeypatch.setattr(callback, "verify", kept_verify)
    return kept


def fit_with_doctor(model, data, checks, **kwargs):
    """``fit`` with a NaNDoctor: its diagnosis, and every remedy checked on the steps the doctor re-ran."""
    doctor = NaNDoctor(verbose=False)
    model.fit(*data, shuffle=False, verbose=0, callbacks=[doctor], **kwargs)
    d = doctor.diagnosis
    assert d is not None and checks, str(d)
    x, y, w = checks["batch"]
    return d, candidates(d, model, checks["loss_fn"], x, y, w, checks["steps"], every=True)


@pytest.fixture
def float32_policy():
    yield
    keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("case", reports.CASES, ids=[c.id for c in reports.CASES])
def test_the_rebuilt_reports_print_a_verified_remedy_first_where_one_verifies(case, float32_policy, checks):
    if "mixed" in case.modes:
        keras.mixed_precision.set_global_policy("mixed_float16")
    model, x, y, loss = case.build()
    model.compile(loss=loss, optimizer=keras.optimizers.SGD(1.0 if case.cause == "divergence" else 1e-3),
                  jit_compile="compiled_xla" in case.modes)
    if case.cause == "divergence":  # the growing run, as fit trained it (reports.run's fit_arrays)
        d, found = fit_with_doctor(model, (x, y), checks, batch_size=4, epochs=3)
        assert d.cause == case.cause, str(d)
        assert_first_is_verified_if_any(d, found)
        return
    d = diagnose(model, (x, y), batch_size=4)
    assert d is not None and d.cause == case.cause, str(d)
    assert_first_is_verified_if_any(d, every_remedy(d, model))


@pytest.mark.parametrize("case", remedy_cases.CASES, ids=[c.id for c in remedy_cases.CASES])
def test_the_remedies_cases_print_a_verified_remedy_first_where_one_verifies(case, float32_policy, checks):
    if "mixed" in case.kinds:
        keras.mixed_precision.set_global_policy("mixed_float16")
    model, x, y, kwargs = case.build(False)
    data = (x, y) if y is not None else (x,)
    growth = [1.0, 1e4, 1e8, 1e12] if "diverge" in case.kinds else ()
    if "diverge" in case.kinds:  # the growing run first, as fit trained it, up to the failing step
        d, found = fit_with_doctor(model, data, checks, **{"epochs": 1, **kwargs})
        assert d.cause == case.cause, str(d)
        assert_first_is_verified_if_any(d, found)
        return
    d = diagnose(model, data, batch_size=kwargs.get("batch_size"), losses_before=growth)
    assert d is not None and d.cause == case.cause, str(d)
    assert_first_is_verified_if_any(d, every_remedy(d, model))


def test_labels_out_of_range_print_the_shift_first_where_it_verifies():
    rng = np.random.default_rng(1)
    x = rng.random((48, 4)).astype("float32")
    model = values._classifier(10, loss=values.yolo_class_loss)
    d = diagnose(model, (x, rng.integers(1, 11, size=48)), batch_size=16)
    found = every_remedy(d, model)
    assert [v.startswith("verified") for _, v in found] == [True, True]  # the shift, and the weighting
    assert_first_is_verified_if_any(d, found)
    assert d.remedy.startswith("labels from 0: y - 1")


def test_a_schedule_below_zero_prints_its_fix_first_and_never_a_smaller_rate(checks):
    model, x, y = values._regression(values.DecayingRate(0.05, 40))
    d, found = fit_with_doctor(model, (x, y), checks, batch_size=16, epochs=40)
    assert len(found) == 2 and found[1][0].startswith("recompile with gradient clipping")
    assert not any("ten times smaller" in remedy for remedy, _ in found)
    assert_first_is_verified_if_any(d, found)


def test_every_cause_is_ordered_by_a_case_or_said_why_not():
    assert set(NOT_ORDERED) <= set(CAUSES)
    if len(SEEN) < 5:
        pytest.skip("run with the other tests of this file: it reads the causes they met")
    missing = set(CAUSES) - SEEN - set(NOT_ORDERED)
    assert not missing, f"no case orders the remedies of {sorted(missing)}"
