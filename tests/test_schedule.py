"""The cross-entropy phase that hard attention's warm-up and the Gumbel temperature are fractions of
(``training.schedule.CrossEntropyPhase``), the runs whose length no schedule can be laid over
(``ModelConfig.unscheduled``), and the learning-rate plan of a resumed run (``LearningRatePlan.resumed``)."""

from __future__ import annotations

import logging
import math
from types import SimpleNamespace

import pytest

from captioner.config import ModelConfig, from_dict
from captioner.training.schedule import CrossEntropyPhase, LearningRatePlan
from conftest import make_decoder

HARD = {"attention": "hard", "decoder": {"hard_expectation_warmup": 0.5, "hard_expectation_prob": 0.5}}


def settings(**options) -> ModelConfig:
    """The model settings of a hard attention run with a warm-up of half its cross-entropy training."""
    return from_dict(ModelConfig, {**HARD, **options})


def phase_of(model: ModelConfig, max_epochs: int, max_steps: int = -1, batches: int = 10) -> CrossEntropyPhase:
    """The phase ``CaptionerModule`` measures as a fit starts (Lightning's limits after it parsed them)."""
    trainer = SimpleNamespace(
        num_training_batches=batches, accumulate_grad_batches=1, max_epochs=max_epochs, max_steps=max_steps
    )
    return CrossEntropyPhase.of_run(model, trainer)


def test_scst_epochs_are_not_part_of_the_warm_up() -> None:
    """The demo's recipe with model=hard: 11 epochs, SCST after 5. Cross-entropy ends at its step 50 reading the
    mix (0.5 of the images the expected context), the warm-up over at step 25, half of it (as a share of the whole
    run, SCST's epochs counted, cross-entropy ended at 50/110 of the warm-up's 0.5: a share of 0.545)."""
    model = settings(objective="scst", scst={"after_epochs": 5})
    phase = phase_of(model, max_epochs=11)
    assert phase.steps == 50 and phase.warmup_end(model) == 25
    assert phase.progress(25) == 0.5 and phase.progress(50) == 1.0 and phase.progress(100) == 1.0
    decoder = make_decoder(attention="hard", hard_expectation_prob=0.5, hard_expectation_warmup=0.5)
    decoder.anneal(phase.progress(50))
    assert decoder.hard_expectation_prob == 0.5
    assert phase_of(settings(), max_epochs=11).steps == 110  # cross-entropy only: the whole run
    assert phase_of(settings(), max_epochs=11, max_steps=25).steps == 25  # max_steps cuts it
    scst_at_once = settings(objective="scst", scst={"after_epochs": 0})  # fine-tunes a trained model
    assert phase_of(scst_at_once, max_epochs=4).steps == 0 and phase_of(scst_at_once, 4).progress(0) == 1.0


def test_the_warm_up_counts_optimiser_steps() -> None:
    trainer = SimpleNamespace(num_training_batches=10, accumulate_grad_batches=3, max_epochs=2, max_steps=-1)
    assert CrossEntropyPhase.of_run(settings(), trainer).steps == 8  # ceil(10 / 3) = 4 steps an epoch


def test_checkpoint_selection_waits_for_the_end_of_a_hard_models_warm_up() -> None:
    phase = CrossEntropyPhase(100)
    assert phase.selection_waits(settings(), 49) and not phase.selection_waits(settings(), 50)
    assert not phase.selection_waits(settings(select_in_warmup=True), 10)  # asked for
    assert not phase.selection_waits(settings(attention="soft"), 10)  # no warm-up: soft attention
    no_warmup = settings(decoder={"hard_expectation_warmup": 0.0})
    assert not phase.selection_waits(no_warmup, 0) and phase.warmup_note(no_warmup) is None
    assert phase.warmup_note(settings()) == (
        "hard attention's warm-up: the share of images reading the expected context falls from 1 to 0.5 until "
        "optimiser step 50 of the 100 of cross-entropy training; no best checkpoint nor early stop before"
    )


@pytest.mark.parametrize(
    "options,max_epochs,needs",
    [
        ({}, None, "model.decoder.hard_expectation_warmup=0.5 (a fraction of cross-entropy training)"),
        ({}, -1, "model.decoder.hard_expectation_warmup=0.5 (a fraction of cross-entropy training)"),
        (
            {"scheduler": {"name": "none"}, "decoder": {"hard_expectation_warmup": 0.0, "hard_estimator": "gumbel"}},
            None,
            "model.decoder.gumbel_tau's fall to gumbel_tau_min (over cross-entropy training)",
        ),
        ({"attention": "soft"}, None, "model.scheduler.name=cosine (over the run's steps)"),
    ],
)
def test_a_run_without_a_length_is_refused_when_something_is_laid_over_it(
    options: dict, max_epochs: int | None, needs: str
) -> None:
    """max_epochs=null is Lightning's 1000 epochs (a warm-up of 500), or no limit with max_time (-1 once parsed)."""
    problem = settings(**options).unscheduled(max_epochs, None)
    limit = "null" if max_epochs is None else max_epochs
    assert problem.startswith(f"trainer.max_epochs={limit} with no trainer.max_steps gives the run no known length")
    assert needs in problem and problem.endswith("set trainer.max_epochs or trainer.max_steps")
    assert "\n" not in problem


def test_a_run_with_a_length_or_nothing_laid_over_it_is_scheduled() -> None:
    assert settings().unscheduled(5, None) is None and settings().unscheduled(None, 300) is None
    assert settings().unscheduled(-1, 300) is None
    plain = settings(attention="soft", scheduler={"name": "none"})
    assert plain.unscheduled(None, None) is None  # nothing to lay out: until max_time or early stopping
    # objective=scst: its cross-entropy epochs bound the warm-up, but the rates' switch to lr x lr_scale is
    # laid out over the run's steps (LearningRatePlan: from the first step of epoch after_epochs)
    bounded = settings(objective="scst", scst={"after_epochs": 3}, scheduler={"name": "none"})
    assert "model.scst.lr_scale=0.1 (from epoch model.scst.after_epochs on)" in bounded.unscheduled(None, None)
    assert "hard_expectation_warmup" not in bounded.unscheduled(None, None)
    at_once = settings(objective="scst", scst={"after_epochs": 0}, scheduler={"name": "none"})
    assert at_once.unscheduled(None, None) is None


def plan_of(model: ModelConfig, max_epochs: int, max_steps: int = -1, batches: int = 500) -> LearningRatePlan:
    """The learning-rate plan ``CaptionerModule.configure_optimizers`` lays over a fit (Lightning's estimate of
    its steps: the steps an epoch times max_epochs, at most max_steps)."""
    steps = batches * max_epochs if math.isfinite(batches) else math.inf
    trainer = SimpleNamespace(
        estimated_stepping_batches=steps if max_steps == -1 else min(steps, max_steps),
        num_training_batches=batches,
        accumulate_grad_batches=1,
        max_epochs=max_epochs,
        max_steps=max_steps,
    )
    return LearningRatePlan.of_run(model, trainer)


SCST = {"objective": "scst", "scst": {"after_epochs": 5, "lr_scale": 0.1}, "scheduler": {"warmup_steps": 0}}


def cosine(progress: float, scale: float = 1.0) -> float:
    return scale * 0.5 * (1 + math.cos(math.pi * progress))


def test_a_resumed_longer_run_goes_on_along_the_cosine_it_was_on() -> None:
    """SCST after 5 epochs of 500 steps, 8 epochs planned, resumed at step 3000 (SCST's cosine at 1/3) with 12:
    SCST's cosine goes on from 1/3 to 1 over the 3000 steps left; the cross-entropy phase, over, is as it was."""
    earlier = plan_of(settings(**SCST), max_epochs=8)
    assert [(p.start, p.end) for p in earlier.phases] == [(0, 2500), (2500, 4000)]
    longer = plan_of(settings(**SCST), max_epochs=12).resumed(earlier.state(), 3000)
    assert longer.factor(3000) == pytest.approx(earlier.factor(3000)) == pytest.approx(cosine(1 / 3, 0.1))
    assert longer.factor(4500) == pytest.approx(cosine(1 / 3 + 2 / 3 * 1500 / 3000, 0.1))
    assert longer.factor(5999) == pytest.approx(0.0, abs=1e-6) and longer.factor(1000) == earlier.factor(1000)
    # resumed inside cross-entropy (step 2000, its cosine at 0.8): it goes on as it was, SCST's laid over 12 epochs
    inside = plan_of(settings(**SCST), max_epochs=12).resumed(earlier.state(), 2000)
    assert inside.factor(2000) == pytest.approx(cosine(0.8)) and inside.factor(2499) == earlier.factor(2499)
    assert inside.factor(2500) == pytest.approx(0.1) and inside.factor(4250) == pytest.approx(cosine(0.5, 0.1))
    # resumed with the same length: the plan it had
    assert plan_of(settings(**SCST), max_epochs=8).resumed(earlier.state(), 3000).factor(3500) == pytest.approx(
        earlier.factor(3500)
    )


def test_a_resumed_run_inside_its_warm_up_keeps_it_and_lays_its_cosine_over_the_new_length() -> None:
    earlier = plan_of(settings(scheduler={"warmup_steps": 100}), max_epochs=2)
    longer = plan_of(settings(scheduler={"warmup_steps": 100}), max_epochs=4).resumed(earlier.state(), 50)
    assert longer.factor(50) == earlier.factor(50) and longer.factor(99) == earlier.factor(99)
    assert longer.factor(100) == 1.0 and longer.factor(1050) == pytest.approx(cosine(0.5))


def test_a_run_resumed_after_its_cosine_ended_stays_at_its_last_rate_and_says_so(caplog) -> None:
    earlier = plan_of(settings(scheduler={"warmup_steps": 0}), max_epochs=2)
    with caplog.at_level(logging.WARNING, logger="captioner.training.schedule"):
        longer = plan_of(settings(scheduler={"warmup_steps": 0}), max_epochs=4).resumed(earlier.state(), 1000)
    assert longer.factor(1000) == longer.factor(1999) == pytest.approx(0.0)
    assert "cosine had ended at step 1000: its steps up to 2000 train at its last rate" in caplog.text


def test_a_loader_without_a_length_lays_the_schedule_over_max_steps() -> None:
    plan = plan_of(settings(**SCST), max_epochs=-1, max_steps=300, batches=math.inf)
    assert [(p.start, p.end) for p in plan.phases] == [(0, 300)]  # its one epoch never ends: no SCST in it
    assert plan.factor(150) == pytest.approx(cosine(0.5))
    assert phase_of(settings(), max_epochs=-1, max_steps=300, batches=math.inf).steps == 300


def test_a_warm_up_longer_than_the_run_says_so_with_its_numbers() -> None:
    """The issue's run: 3 epochs of 10 steps, the default warm-up of 50 steps: the rate only rises, over all 30."""
    model = from_dict(ModelConfig, {})
    plan = plan_of(model, max_epochs=3, batches=10)
    assert plan.factor(29) == 1.0 and plan.factor(0) == pytest.approx(1e-3)  # the warm-up takes every step
    assert plan.warmup_note(0.002) == (
        "model.scheduler.warmup_steps=50 warms up over all 30 optimiser steps of this run's cross-entropy training: "
        "its learning rate only rises, from 2e-06 to 0.002 at its last step, and the cosine schedule never decays it "
        "(a warm-up of at most 3 step(s), a tenth of them, leaves it room)"
    )
    assert plan_of(model, max_epochs=6, batches=10).warmup_note(0.002) is None  # 50 of 60 steps: it decays after
    flat = from_dict(ModelConfig, {"scheduler": {"name": "none", "warmup_steps": 29}})
    note = plan_of(flat, max_epochs=3, batches=10).warmup_note(0.01)
    assert note.endswith(
        "from 1e-05 to 0.01 at its last step (a warm-up of at most 3 step(s), a tenth of them, leaves it room)"
    )
    # SCST at once: no cross-entropy phase to warm up; cross-entropy for 1 epoch, then SCST: the first epoch's
    assert plan_of(settings(**{**SCST, "scst": {"after_epochs": 0}}), max_epochs=3, batches=10).warmup_note(1) is None
    scst = settings(objective="scst", scst={"after_epochs": 1})
    assert "over all 10 optimiser steps" in plan_of(scst, max_epochs=3, batches=10).warmup_note(1)
