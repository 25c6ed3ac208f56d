"""The learning-rate schedule, stepped every optimiser step, and the self-critical phase of a run.

A run with ``objective=scst`` and ``scst.after_epochs`` > 0 trains with cross-entropy first, then with
SCST; the schedule then has two phases: the configured one (warm-up, cosine or step decay) over the
cross-entropy steps, and the same again (without warm-up) from ``scst.lr_scale`` times the rates over the
SCST steps.
"""

from __future__ import annotations

import math

import torch

from captioner.config import Objective, Schedule, SchedulerConfig, ScstConfig


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
