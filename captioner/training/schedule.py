"""The learning-rate schedule, stepped every optimiser step, and the self-critical phase of a run.

A run with ``objective=scst`` and ``scst.after_epochs`` > 0 trains with cross-entropy first, then with
SCST; the schedule then has two phases: the configured one (warm-up, cosine or step decay) over the
cross-entropy steps, and the same again (without warm-up) from ``scst.lr_scale`` times the rates over the
SCST steps. Both are laid over the run's real steps (``LearningRatePlan``: the train loader's steps an epoch,
the run bounded by max_epochs and max_steps), so that the rates switch where the objective does, and a resumed
run of another length goes on from the rate it stopped at.

Hard attention's decoder anneals over the cross-entropy phase alone (``CrossEntropyPhase``): its
expected-context warm-up and its Gumbel temperature; a run whose length is unknown is refused
(``ModelConfig.unscheduled``) when anything is laid out over it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import lightning as L
import torch

from captioner.config import Attention, ModelConfig, Objective, Schedule, SchedulerConfig, ScstConfig

log = logging.getLogger(__name__)


def self_critical_epoch(objective: Objective, scst: ScstConfig, epoch: int) -> bool:
    """Whether ``epoch`` trains with SCST (objective=scst, after ``scst.after_epochs`` cross-entropy epochs)."""
    return objective == Objective.scst and epoch >= scst.after_epochs


def steps_per_epoch(trainer: L.Trainer) -> int | None:
    """The optimiser steps of one training epoch: the train loader's batches (as Lightning set it up, per rank,
    ``limit_train_batches`` applied) over gradient accumulation, a last partial accumulation counted; None for a
    loader without a length."""
    batches = trainer.num_training_batches
    return math.ceil(batches / trainer.accumulate_grad_batches) if math.isfinite(batches) else None


@dataclass(frozen=True)
class Phase:
    """One objective's stretch of the learning-rate schedule: optimiser steps ``start`` to ``end`` (excluded), at
    ``scale`` times the rates, a linear warm-up over its first ``warmup`` steps, then the schedule's decay. A
    cosine's progress runs linearly from ``progress`` at step ``anchor`` to 1 at ``end``: from 0 where the
    warm-up ends, or, in a resumed run, from where the run it resumes had got to (:meth:`LearningRatePlan.resumed`).
    """

    start: int
    end: int
    scale: float
    warmup: int
    anchor: int
    progress: float = 0.0

    @classmethod
    def laid(cls, start: int, end: int, scale: float, warmup: int) -> Phase:
        """The phase of steps ``start`` to ``end``, its cosine from 0 after a warm-up of ``warmup`` steps (fewer
        where the phase is shorter)."""
        warmup = min(warmup, max(0, end - start - 1))
        return cls(start, end, scale, warmup, start + warmup)

    def cosine_progress(self, step: int) -> float:
        """The cosine's progress at optimiser ``step``, in [0, 1]."""
        share = (step - self.anchor) / max(1, self.end - self.anchor)
        return min(1.0, max(0.0, self.progress + (1.0 - self.progress) * share))


@dataclass(frozen=True)
class LearningRatePlan:
    """The learning-rate factor at every optimiser step of a run: its phases, cross-entropy then (objective=scst
    after ``scst.after_epochs`` epochs) SCST, whose decay ``schedule`` gives (step decay every ``step_size``
    epochs of ``steps_per_epoch`` steps).

    Laid over the run's real length (:meth:`of_run`), and kept in its checkpoints, so that a resumed run of
    another length (a larger trainer.max_epochs, say) goes on from the rate it stopped at (:meth:`resumed`).
    """

    schedule: SchedulerConfig
    steps_per_epoch: int
    phases: tuple[Phase, ...]

    @classmethod
    def of_run(cls, settings: ModelConfig, trainer: L.Trainer) -> LearningRatePlan:
        """The plan of the run ``trainer`` is starting with the model's ``settings``: over Lightning's estimate
        of its optimiser steps (the train loader's steps an epoch times ``max_epochs``, at most ``max_steps``; it
        sets the loader up where Lightning has not yet), SCST from the first step of epoch ``scst.after_epochs``,
        as ``self_critical_epoch`` switches the objective."""
        estimate = trainer.estimated_stepping_batches  # first: it sets the train loader up, if not yet
        total = max(1, int(estimate) if math.isfinite(estimate) else 0)  # unbounded: ModelConfig.unscheduled
        per_epoch = steps_per_epoch(trainer) or total  # a loader without a length: one epoch, never ending
        switch = total
        if settings.objective == Objective.scst and settings.scst.after_epochs > 0:
            switch = min(total, settings.scst.after_epochs * per_epoch)
        schedule = settings.scheduler
        phases = [Phase.laid(0, switch, 1.0, schedule.warmup_steps)]
        if switch < total:
            phases.append(Phase.laid(switch, total, settings.scst.lr_scale, 0))
        return cls(schedule, max(1, per_epoch), tuple(phases))

    def warmup_note(self, lr: float) -> str | None:
        """A line saying that the warm-up takes the whole cross-entropy phase, so that the learning rate (``lr``
        after the warm-up) only rises over it (None: the warm-up is shorter, or there is none)."""
        first = self.phases[0]
        steps = first.end - first.start
        if steps < 2 or first.warmup < steps - 1:
            return None
        name = self.schedule.name
        decay = "" if name == Schedule.none else f", and the {name} schedule never decays it"
        start, peak = lr * self.factor(first.start), lr * self.factor(first.end - 1)
        return (
            f"model.scheduler.warmup_steps={self.schedule.warmup_steps} warms up over all {steps} optimiser steps of "
            f"this run's cross-entropy training: its learning rate only rises, from {start:.3g} to {peak:.3g} at its "
            f"last step{decay} (a warm-up of at most {max(1, steps // 10)} step(s), a tenth of them, leaves it room)"
        )

    def factor(self, step: int) -> float:
        """The learning-rate factor at optimiser ``step``."""
        phase = next((phase for phase in reversed(self.phases) if phase.start <= step), self.phases[0])
        local = step - phase.start
        if local < phase.warmup:
            return phase.scale * (1e-3 + (1 - 1e-3) * local / phase.warmup)  # linear, from 1e-3
        if self.schedule.name == Schedule.none:
            return phase.scale
        if self.schedule.name == Schedule.cosine:
            return phase.scale * 0.5 * (1 + math.cos(math.pi * phase.cosine_progress(step)))
        decays = (local - phase.warmup) // (self.schedule.step_size * self.steps_per_epoch)
        return phase.scale * self.schedule.gamma**decays

    def state(self) -> list[dict[str, int | float]]:
        """The phases as plain data, for a checkpoint."""
        return [dataclasses.asdict(phase) for phase in self.phases]

    def resumed(self, earlier: list[dict[str, int | float]], step: int) -> LearningRatePlan:
        """This plan for a run resumed at optimiser ``step`` from a checkpoint whose plan had the phases
        ``earlier`` (:meth:`state`), as the warm-up goes on from the checkpoint's: a phase whose cosine had begun
        goes on from the progress it had reached at ``step``, now to this run's end of the phase (no jump in the
        rate: the rest of the same cosine, slower or faster); a phase not yet begun is laid over this run."""
        phases = []
        for index, phase in enumerate(self.phases):
            before = Phase(**earlier[index]) if index < len(earlier) else None
            if before is not None and before.start == phase.start and before.anchor < step < phase.end:
                progress = before.cosine_progress(step)
                phase = dataclasses.replace(
                    phase, warmup=min(phase.warmup, step - phase.start), anchor=step, progress=progress
                )
                if progress == 1.0 and self.schedule.name == Schedule.cosine:
                    log.warning(
                        "the resumed run's learning-rate cosine had ended at step %d: its steps up to %d train at "
                        "its last rate (init_from, not ckpt_path, starts a new run and schedule from its weights)",
                        before.end,
                        phase.end,
                    )
            phases.append(phase)
        return dataclasses.replace(self, phases=tuple(phases))


def build_scheduler(optimizer: torch.optim.Optimizer, plan: LearningRatePlan) -> torch.optim.lr_scheduler.LambdaLR:
    """The scheduler stepping ``optimizer``'s rates by ``plan`` every optimiser step (constant rates too: every run
    logs its rates under the scheduler's name, ``training.loggers.LEARNING_RATES``)."""

    def factor(step: int) -> float:  # a function, not an object: LambdaLR leaves it out of its state dict
        return plan.factor(step)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def cross_entropy_steps(
    objective: Objective, scst: ScstConfig, max_epochs: int | None, max_steps: int | None, per_epoch: int | None
) -> int | None:
    """The optimiser steps a run trains with cross-entropy: ``scst.after_epochs`` epochs of an objective=scst run
    (0 when SCST starts at once), else the whole run of ``max_epochs`` epochs (None or -1: no limit) of
    ``per_epoch`` steps (None: a loader without a length, an epoch without end), at most ``max_steps`` (None or
    -1: no limit); None when nothing bounds it."""
    epochs = scst.after_epochs if objective == Objective.scst else max_epochs
    if epochs == 0:
        steps = 0
    elif epochs in (None, -1) or per_epoch is None:
        steps = None
    else:
        steps = epochs * per_epoch
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
        limits = (trainer.max_epochs, trainer.max_steps, steps_per_epoch(trainer))
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
