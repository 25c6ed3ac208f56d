"""CaptionerModule: the model it builds from its settings, the loss it trains, and its optimiser steps."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from captioner.config import ModelConfig, NonFinite, from_dict
from captioner.data.vocab import PAD_ID, UNK_ID, Vocabulary
from captioner.model.captioner import build_captioner
from captioner.model.self_attention import SelfAttentionStack
from captioner.training.callbacks import NonFiniteLossError, NonFiniteLossGuard, skip_flagged_step
from captioner.training.module import CaptionerModule
from captioner.training.validate import validate_config
from conftest import compose_cfg

CAPTIONS = ["a red circle", "a blue square on the left", "a green triangle at the top"]
SMALL = {"name": "resnet18", "stage": "layer1", "grid": 2}


@pytest.fixture(scope="module")
def vocab() -> Vocabulary:
    return Vocabulary.build(CAPTIONS, min_count=1)


@pytest.mark.parametrize(("self_attention", "blocks"), [(None, 0), ({"blocks": 0}, 0), ({}, 0), ({"blocks": 2}, 2)])
def test_self_attention_blocks_are_built_only_when_asked(vocab, self_attention, blocks):
    module = CaptionerModule(vocab, from_dict(ModelConfig, dict(encoder=SMALL, self_attention=self_attention)))
    stack = module.model.self_attention
    assert (0 if stack is None else len(stack.blocks)) == blocks
    assert stack is None or isinstance(stack, SelfAttentionStack)
    rebuilt = build_captioner(module.net, len(vocab)).self_attention  # what the bundle rebuilds
    assert (0 if rebuilt is None else len(rebuilt.blocks)) == blocks


def test_unk_is_excluded_from_the_loss(vocab):
    module = CaptionerModule(vocab, from_dict(ModelConfig, dict(encoder=SMALL)))
    assert module.criterion.unk_id == UNK_ID and module.criterion.pad_id == PAD_ID


@pytest.mark.parametrize("fused", [True, False])
def test_a_flagged_optimiser_step_changes_nothing(fused: bool) -> None:
    """The step of a non-finite loss leaves the parameters, Adam's moments and its step count as they were:
    fused Adam skips it on the device; an unfused one (loaded from an older checkpoint) gets no gradients."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(2)]
    optimizer = torch.optim.Adam(params, lr=0.1, fused=fused)
    for scale in (1.0, float("nan"), 1.0):
        optimizer.zero_grad()
        loss = sum((p**2).sum() for p in params) * scale
        loss.backward()
        before = [p.detach().clone() for p in params]
        moments = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
        skip_flagged_step(optimizer, ~torch.isfinite(loss))  # what the guard does with the step's flag
        optimizer.step()
        changed = [not torch.equal(b, p) for b, p in zip(before, params)]
        if scale == scale:
            assert all(changed)
        else:
            assert not any(changed)
            for p, saved in zip(params, moments):
                assert all(torch.equal(value, optimizer.state[p][key]) for key, value in saved.items())
    assert [float(optimizer.state[p]["step"]) for p in params] == [2.0, 2.0]


def test_every_run_gets_the_guard_with_the_models_settings(vocab) -> None:
    module = CaptionerModule(
        vocab, from_dict(ModelConfig, dict(encoder=SMALL, nonfinite="skip", nonfinite_check_interval=7))
    )
    (guard,) = module.configure_callbacks()
    assert isinstance(guard, NonFiniteLossGuard) and guard.action == NonFinite.skip and guard.check_interval == 7


def test_the_stop_error_names_the_step_and_the_last_checkpoint() -> None:
    error = NonFiniteLossError(float("inf"), "epoch 2, step 40", "runs/x/checkpoints/last.ckpt")
    assert str(error) == (
        "non-finite loss (inf) at epoch 2, step 40; training stopped, the last good checkpoint is "
        "runs/x/checkpoints/last.ckpt (model.nonfinite=skip skips such batches instead)"
    )
    assert "no checkpoint had been saved yet" in str(NonFiniteLossError(float("nan"), "epoch 0, step 1", None))


def test_validation_decodes_with_the_configured_constraints(tmp_path: Path) -> None:
    cfg = compose_cfg(
        [
            "model.decoding.method=beam",
            "model.decoding.max_len=8",
            "model.decoding.min_len=3",
            "model.decoding.no_repeat_ngram_size=1",
        ],
        tmp_path,
    )
    settings = validate_config(OmegaConf.to_container(cfg, resolve=True))
    torch.manual_seed(0)
    module = CaptionerModule(Vocabulary([f"w{i}" for i in range(20)]), settings.model).eval()
    features, _ = module.model.encode(torch.randn(16, 3, 96, 96))  # what the demo's feature cache holds
    generation, _ = module.generate({"features": features})
    for row in range(16):
        words = generation.tokens[row, : generation.lengths[row]].tolist()
        assert len(words) > 3 and len(set(words)) == len(words)  # 3 words before <end> at least, none twice
    module.settings.decoding.no_repeat_ngram_size = 0
    free, _ = module.generate({"features": features})
    assert any(len(set(row[:n].tolist())) < n for row, n in zip(free.tokens, free.lengths))  # without: repeats
    module.settings.decoding.min_len = 0
    short, _ = module.generate({"features": features})
    assert any(n <= 3 for n in short.lengths.tolist())  # without: shorter captions (this untrained model's)


def _trainer(epochs: int, batches: int, max_steps: int = -1, accumulate: int = 1) -> SimpleNamespace:
    """What configure_optimizers reads of a trainer of ``epochs`` epochs of ``batches`` training batches
    (Lightning's estimate: optimiser steps an epoch times the epochs, at most ``max_steps``)."""
    steps = math.ceil(batches / accumulate) * epochs
    return SimpleNamespace(
        estimated_stepping_batches=steps if max_steps == -1 else min(steps, max_steps),
        num_training_batches=batches,
        accumulate_grad_batches=accumulate,
        max_epochs=epochs,
        max_steps=max_steps,
    )


def _learning_rates(module: CaptionerModule, epochs: int, steps_per_epoch: int) -> list[float]:
    """The decoder group's learning rate at every training step of the module's schedule."""
    module.trainer = _trainer(epochs, steps_per_epoch)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    rates = []
    for _ in range(epochs * steps_per_epoch):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


def test_scst_after_cross_entropy_epochs_starts_its_schedule_again_at_the_lower_rate(vocab):
    """objective=scst with scst.after_epochs=2 of 4: warm-up and cosine to ~0 over the cross-entropy epochs,
    then the cosine again from lr * lr_scale over the SCST epochs."""
    settings = dict(encoder=SMALL, optimizer={"lr": 0.01}, scheduler={"warmup_steps": 5})
    module = CaptionerModule(
        vocab, from_dict(ModelConfig, dict(objective="scst", scst={"after_epochs": 2, "lr_scale": 0.1}, **settings))
    )
    rates = _learning_rates(module, epochs=4, steps_per_epoch=10)
    assert rates[0] == pytest.approx(1e-5) and rates[5] == pytest.approx(0.01)  # warm-up from 1e-3 x lr
    assert rates[19] < 1e-3 and all(a >= b for a, b in zip(rates[5:20], rates[6:20]))  # cosine, CE phase
    assert rates[20] == pytest.approx(0.001)  # SCST: no warm-up, lr x lr_scale
    assert rates[39] < 1e-4 and all(a >= b for a, b in zip(rates[20:], rates[21:]))
    # a cross-entropy run's single schedule, for comparison: one cosine over the whole run
    single = _learning_rates(
        CaptionerModule(vocab, from_dict(ModelConfig, dict(objective="cross_entropy", **settings))),
        epochs=4,
        steps_per_epoch=10,
    )
    assert single[:5] == pytest.approx(rates[:5]) and single[20] == pytest.approx(
        0.01 * 0.5 * (1 + math.cos(math.pi * 15 / 35))
    )


def _factor(module: CaptionerModule, trainer: SimpleNamespace):
    """The module's learning-rate factor by optimiser step, for a fit by ``trainer``."""
    module.trainer = trainer
    return module.configure_optimizers()["lr_scheduler"]["scheduler"].lr_lambdas[0]


def test_the_schedule_and_the_switch_to_scst_follow_max_steps(vocab):
    """500 batches an epoch, 20 epochs, max_steps=4000, SCST after 5 epochs: SCST takes over at step 2500 (its
    epoch 5), so the cross-entropy cosine falls over steps 0-2499 and SCST's over 2500-3999, where 4000 // 20 =
    200 "steps an epoch" put the switch at step 1000."""
    scst = {"after_epochs": 5, "lr_scale": 0.1}
    settings = dict(encoder=SMALL, objective="scst", scst=scst, scheduler={"warmup_steps": 0})
    factor = _factor(CaptionerModule(vocab, from_dict(ModelConfig, settings)), _trainer(20, 500, max_steps=4000))
    assert factor(999) == pytest.approx(0.5 * (1 + math.cos(math.pi * 999 / 2500)))
    assert factor(2499) == pytest.approx(0.0, abs=1e-5) and factor(2500) == pytest.approx(0.1)
    assert factor(3250) == pytest.approx(0.05) and factor(3999) == pytest.approx(0.0, abs=1e-5)
    # gradient accumulation: 1000 batches, 2 a step, are the same 500 steps an epoch
    accumulated = _factor(CaptionerModule(vocab, from_dict(ModelConfig, settings)), _trainer(20, 1000, 4000, 2))
    assert accumulated(2499) == pytest.approx(factor(2499)) and accumulated(2500) == pytest.approx(0.1)


def test_step_decay_decays_every_step_size_epochs_of_the_loaders_steps(vocab):
    """step_size=2 epochs of 500 steps, gamma 0.5: halved at steps 1000, 2000 and 3000 of a run that max_steps=4000
    bounds (4000 // 20 epochs = 200 "steps an epoch" halved it every 400 steps)."""
    scheduler = {"name": "step", "step_size": 2, "gamma": 0.5, "warmup_steps": 0}
    module = CaptionerModule(vocab, from_dict(ModelConfig, dict(encoder=SMALL, scheduler=scheduler)))
    factor = _factor(module, _trainer(20, 500, max_steps=4000))
    assert [factor(step) for step in (0, 999, 1000, 1999, 2000, 3999)] == [1.0, 1.0, 0.5, 0.5, 0.25, 0.125]


def test_scst_takes_over_after_the_cross_entropy_epochs(vocab):
    module = CaptionerModule(
        vocab, from_dict(ModelConfig, dict(encoder=SMALL, objective="scst", scst={"after_epochs": 2}))
    )
    module.trainer = SimpleNamespace(current_epoch=1)
    assert not module.scst_epoch
    module.trainer.current_epoch = 2
    assert module.scst_epoch
    assert not CaptionerModule(vocab, from_dict(ModelConfig, dict(encoder=SMALL, objective="cross_entropy"))).scst_epoch


def test_a_validation_that_decoded_no_image_stops_the_run_in_one_line(vocab) -> None:
    from captioner.data.dataset import Skipped
    from captioner.errors import DataError
    from captioner.training.evaluation import EvaluationEpoch

    module = CaptionerModule(vocab, from_dict(ModelConfig, dict(encoder=SMALL)))
    module.skips.add([Skipped("val/1.jpg", "not an image file"), Skipped("val/2.jpg", "not an image file")])
    module._evaluation = EvaluationEpoch("val", {1: [["a"]], 2: [["a"]]}, {})
    with pytest.raises(DataError) as info:
        module.on_validation_epoch_end()
    assert str(info.value) == (
        "no val image could be decoded (skipped 2 unreadable images: val/1.jpg (not an image file); and 1 more), "
        "so there is nothing to score: the run stops (docs/datasets.md#images)"
    )
