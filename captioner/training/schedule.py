"""The learning-rate schedule, stepped every optimiser step, and the self-critical phase of a run.

A run with ``objective=scst`` and ``scst.after_epochs`` > 0 trains with cross-entropy first, then with
SCST; the schedule then has two phases: the configured one (warm-up, cosine or step decay) over the
cross-entropy steps, and the same again (without warm-up) from ``scst.lr_scale`` times the rates over the
SCST steps.

Hard attention's decoder anneals over the cross-entropy phase alone (``CrossEntropyPhase``): its
expected-context warm-up and its Gumbel temperature; a run whose length is unknown is refused
(``ModelConfig.unscheduled``) when anything is laid out over it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import lightning as L
import torch

from captioner.config import Attention, ModelConfig, Objective, Schedule, SchedulerConfig, ScstConfig


def self_critical_epoch(objective: Objective, scst: ScstConfig, epoch: int) -> bool:
    """Whether ``epoch`` trains with SCST (objective=scst, after ``scst.after_epochs`` cross-entropy epochs)."""
    return objective == Objective.scst and epoch >= scst.after_epochs


def build_scheduler(
    optimizer: torch.optim.Optimizer,
    schedule: SchedulerConfig,
    objective: Objective,
    scst: ScstConfig,
    total_steps: int,
    max_epochs: int,
) -> torch.optim.lr_scheduler.LambdaLR | None:
    """The schedule of ``total_steps`` optimiser steps over ``max_epochs`` epochs (None: constant rates)."""
    total = max(1, total_steps)
    steps_per_epoch = max(1, total // max(1, max_epochs))
    switch = total
    if objective == Objective.scst and scst.after_epochs > 0:
        switch = min(total, scst.after_epochs * steps_per_epoch)
    elif schedule.name == Schedule.none:
        return None

    def factor(step: int) -> float:  # a function, not an object: LambdaLR leaves it out of its state dict
        if step < switch:
            return schedule_factor(schedule, step, switch, schedule.warmup_steps, steps_per_epoch)
        return scst.lr_scale * schedule_factor(schedule, step - switch, total - switch, 0, steps_per_epoch)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def schedule_factor(schedule: SchedulerConfig, step: int, steps: int, warmup: int, steps_per_epoch: int) -> float:
    """The learning-rate factor at ``step`` of a phase of ``steps`` steps with ``warmup`` warm-up steps."""
    if schedule.name == Schedule.none:
        return 1.0
    warmup = min(warmup, max(0, steps - 1))
    if step < warmup:
        return 1e-3 + (1 - 1e-3) * step / warmup  # linear, from 1e-3
    if schedule.name == Schedule.cosine:
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))
    return schedule.gamma ** ((step - warmup) // (schedule.step_size * steps_per_epoch))  # step


def cross_entropy_steps(
    objective: Objective, scst: ScstConfig, max_epochs: int | None, max_steps: int | None, steps_per_epoch: int
) -> int | None:
    """The optimiser steps a run trains with cross-entropy: ``scst.after_epochs`` epochs of an objective=scst run
    (0 when SCST starts at once), else the whole run of ``max_epochs`` epochs (None or -1: no limit) of
    ``steps_per_epoch`` steps, at most ``max_steps`` (None or -1: no limit); None when nothing bounds it."""
    epochs = scst.after_epochs if objective == Objective.scst else max_epochs
    steps = None if epochs in (None, -1) else epochs * steps_per_epoch
    if max_steps not in (None, -1):
        steps = max_steps if steps is None else min(steps, max_steps)
    return steps


@dataclass
class CrossEntropyPhase:
    """The optimiser steps of a run's cross-entropy training, over which the decoder anneals (hard attention's
    expected-context warm-up, the Gumbel temperature: ``ShowAttendTellDecoder.anneal``).

    Measured when training starts and kept in the run's checkpoints, so that SCST epochs never count and a
    resumed run (with a larger trainer.max_epochs, say) carries on the same warm-up. ``steps`` None: nothing
    bounds cross-entropy training and nothing anneals (``ModelConfig.unscheduled`` refuses the runs where
    something would).
    """

    steps: int | None

    @classmethod
    def of_run(cls, settings: ModelConfig, trainer: L.Trainer) -> CrossEntropyPhase:
        """The phase of the run ``trainer`` is starting with the model's ``settings``."""
        steps_per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
        limits = (trainer.max_epochs, trainer.max_steps, steps_per_epoch)
        return cls(cross_entropy_steps(settings.objective, settings.scst, *limits))

    def progress(self, step: int) -> float:
        """The share of cross-entropy training done after ``step`` optimiser steps, in [0, 1]."""
        return 1.0 if not self.steps else min(step / self.steps, 1.0)

    def warmup_end(self, settings: ModelConfig) -> int:
        """The optimiser step at which hard attention's warm-up ends (0: a soft model, or no warm-up)."""
        if settings.attention != Attention.hard:
            return 0
        return math.ceil(settings.decoder.hard_expectation_warmup * (self.steps or 0))

    def selection_waits(self, settings: ModelConfig, step: int) -> bool:
        """Whether a validation after ``step`` optimiser steps is inside the warm-up and may not select the best
        checkpoint nor count for early stopping (``settings.select_in_warmup`` false)."""
        return not settings.select_in_warmup and step < self.warmup_end(settings)

    def warmup_note(self, settings: ModelConfig) -> str | None:
        """A line saying when hard attention's warm-up ends (None: there is none)."""
        end = self.warmup_end(settings)
        if end == 0:
            return None
        waits = "; no best checkpoint nor early stop before" if not settings.select_in_warmup else ""
        return (
            f"hard attention's warm-up: the share of images reading the expected context falls from 1 to "
            f"{settings.decoder.hard_expectation_prob} until optimiser step {end} of the {self.steps} of "
            f"cross-entropy training{waits}"
        )
