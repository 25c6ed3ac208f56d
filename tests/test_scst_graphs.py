"""``model.graphs``' SCST steps on the CPU: what the two CUDA graphs of a self-critical step replay (the forward with
its rollout and greedy baseline, then the loss's backward, CIDEr-D scored between them), run without capturing
them (``SelfCriticalSteps(capture=False)``), train as the eager steps do from the same weights and random draws:
the same rewards, losses and weights after every step, dropout and hard attention's sampled locations included;
the rollout keeps one width (all ``max_len`` words) whatever the batch; an epoch's last batch padded with masked
rows replays without another capture, a batch of other shapes runs eagerly; Lightning switches from the
cross-entropy graph to the SCST graphs at ``scst.after_epochs`` and reports both. tests/test_gpu_graphs.py captures
the same path on a GPU."""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed as dist
from torch.testing import assert_close
from torch.utils.data import DataLoader

from captioner.config import ModelConfig
from captioner.data.vocab import Vocabulary
from captioner.evaluation.cider import CiderD
from captioner.training.graphed import SelfCriticalSteps, self_critical_graphs
from captioner.training.module import CaptionerModule
from captioner.training.optimization import build_optimizer
from test_precision import WORDS, steps_trainer, tiny_module

MAX_LEN = 6  # words a rollout runs with static shapes
SAMPLES = 3  # captions sampled per image
IMAGES = 6  # images of the reward's corpus


def scst_module(
    kind: type[CaptionerModule] = CaptionerModule,
    attention: str = "soft",
    baseline: str = "mean",
    after_epochs: int = 0,
    **settings,
) -> CaptionerModule:
    """A tiny SCST captioner (test_precision.tiny_module with these settings) with dropout, so that the steps draw
    it, and static shapes, the rollout's in the eager steps too: both draw the same numbers in the same order; SCST
    after ``after_epochs`` cross-entropy epochs. ``settings``: other ``model`` settings."""
    scst = dict(
        attention=attention,
        decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.3},
        decoding={"max_len": MAX_LEN},
        objective="scst",
        scst={"samples": SAMPLES, "baseline": baseline, "after_epochs": after_epochs},
        static_shapes=True,
        nonfinite=ModelConfig.nonfinite.value,  # the default: no skipped steps to tell apart
    )
    return tiny_module(kind, **(scst | settings))


def toy_cider(vocab: Vocabulary, device: torch.device | str = "cpu") -> CiderD:
    """CIDEr-D over ``IMAGES`` images, image i described by three and by four words from word i on."""
    words = vocab.itos[4:]  # after <pad>, <start>, <end>, <unk>
    references = [[[words[(i + j) % len(words)] for j in range(n)] for n in (3, 4)] for i in range(IMAGES)]
    return CiderD(references, words=vocab.itos, device=device)


def scst_batch(seed: int, channels: int, images: int = 4, masked: int = 0) -> dict:
    """A training batch of ``images`` cached grids (2x2) with two captions each, the last ``masked`` of them masked
    rows (``collate``'s: zero features, weightless captions, corpus index 0)."""
    generator = torch.Generator().manual_seed(seed)
    features = torch.randn(images, 4, channels, generator=generator)
    real = torch.arange(images) < images - masked
    features[~real] = 0.0
    words = torch.randint(4, 4 + len(WORDS), (2 * images, 5), generator=generator)
    return {
        "features": features,
        "captions": torch.cat([torch.ones(2 * images, 1, dtype=torch.long), words, torch.full((2 * images, 1), 2)], 1),
        "image_index": torch.arange(images).repeat_interleave(2),
        "caption_weights": real.repeat_interleave(2).float(),
        "real": real,
        "indices": torch.randint(0, IMAGES, (images,), generator=generator).masked_fill(~real, 0),
        "skipped": [],
    }


def adam(module: CaptionerModule) -> torch.optim.Optimizer:
    return build_optimizer([p for p in module.parameters() if p.requires_grad], [], module.settings.optimizer)


@pytest.fixture
def one_rank(tmp_path: Path) -> Iterator[None]:
    """A gloo process group of this process alone: all-reduces run, and change nothing."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize(
    ("attention", "baseline", "distributed"),
    [("soft", "mean", False), ("hard", "greedy", False), ("soft", "mean", True)],
    ids=["soft-mean", "hard-greedy", "soft-mean-ddp"],
)
def test_graphed_scst_steps_equal_eager_steps_from_the_same_draws(
    attention: str, baseline: str, distributed: bool, request: pytest.FixtureRequest
) -> None:
    """Under DDP (one rank of its own: the global token count is this rank's) the steps also carry the loss's
    normaliser, all-reduced between the two graphs."""
    if distributed:
        request.getfixturevalue("one_rank")
    eager = scst_module(attention=attention, baseline=baseline).train()
    graphed = copy.deepcopy(eager)
    start = copy.deepcopy(eager.state_dict())
    eager.cider = graphed.cider = toy_cider(eager.vocab)
    steps = self_critical_graphs(
        graphed.model,
        graphed.self_critical,
        lambda: graphed.cider,
        torch.float32,
        graphed.settings,
        capture=False,
        distributed=distributed,
    )
    widths = []  # of every rollout the graphed steps run
    sampled = steps.samples
    steps.samples = lambda batch: widths.append(tuple((drawn := sampled(batch)).drawn.tokens.shape)) or drawn
    normalisers = []  # of every step's rewards: the loss's normaliser, or None
    scored = steps.rewards
    steps.rewards = lambda batch, drawn: normalisers.append((rewards := scored(batch, drawn))[2]) or rewards
    channels = eager.model.encoder.out_channels
    # three full batches, an epoch's last padded with two masked rows, then a ragged one (three images)
    batches = [scst_batch(seed, channels) for seed in range(3)]
    batches += [scst_batch(3, channels, masked=2), scst_batch(4, channels, images=3)]
    optimizers = adam(eager), adam(graphed)
    for step, batch in enumerate(batches):
        torch.manual_seed(100 + step)  # the step's draws: dropout, words, locations
        terms = eager.self_critical_terms(batch)
        optimizers[0].zero_grad()
        terms["loss"].backward()
        torch.manual_seed(100 + step)
        replayed = steps.step(batch)
        optimizers[1].zero_grad()
        if replayed is None:  # another shape: the module's eager step
            replayed = graphed.self_critical_terms(batch)
            replayed["loss"].backward()
        else:
            steps.attach_gradients()
        for module, optimizer in zip((eager, graphed), optimizers):
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 5.0)
            optimizer.step()
        names = {"loss", "reward", *(["greedy_reward"] if baseline == "greedy" else [])}
        assert terms.keys() == replayed.keys() == names
        for name, value in terms.items():
            assert_close(replayed[name], value.detach(), rtol=1e-6, atol=1e-7, msg=f"step {step}: {name}")
    assert steps.counts == {"replayed": 4, "eager": 1} and steps.captures == 1  # the padded batch captured nothing
    # the warm-up's two steps and the four replayed ones: all max_len words of 4 images x 3 samples
    assert widths == [(4 * SAMPLES, MAX_LEN)] * 6
    assert all((tokens is not None) == distributed for tokens in normalisers) and len(normalisers) == 6
    moved = 0
    for name, value in eager.state_dict().items():
        assert_close(graphed.state_dict()[name], value, rtol=1e-6, atol=1e-7, msg=name)
        moved += not torch.equal(value, start[name])
    assert moved > 10  # the steps reached the weights (and the feature norm's statistics)


def test_without_static_shapes_scst_steps_run_eagerly(caplog: pytest.LogCaptureFixture) -> None:
    module = scst_module(static_shapes=False)
    with caplog.at_level(logging.INFO, logger="captioner.training.graphed"):
        steps = self_critical_graphs(module.model, module.self_critical, lambda: None, torch.float32, module.settings)
    assert steps is None
    assert "SCST steps run eagerly, model.static_shapes=false" in caplog.text


class ToyCorpus(CaptionerModule):
    """The SCST module on ``toy_cider``'s corpus (a fit without a data module), its steps through ``model.graphs``'
    path uncaptured when ``graphs``."""

    graphs = False

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if stage == "fit" and self.graphs:
            self.use_training_graphs(capture=False)

    def on_fit_start(self) -> None:
        self.cider = toy_cider(self.vocab)


class GraphedToyCorpus(ToyCorpus):
    graphs = True


def test_lightning_switches_from_the_cross_entropy_graph_to_the_scst_graphs(caplog: pytest.LogCaptureFixture) -> None:
    """objective=scst after one cross-entropy epoch: the first epoch replays the cross-entropy graph, the second the
    SCST graphs (its last batch padded with a masked row), and the weights are the eager run's."""
    states = []
    for kind in (ToyCorpus, GraphedToyCorpus):
        module = scst_module(kind, after_epochs=1)
        channels = module.model.encoder.out_channels
        data = [scst_batch(seed, channels, masked=seed % 3 // 2) for seed in range(3)]
        trainer = steps_trainer(-1, L.Callback(), max_epochs=2, gradient_clip_val=5.0)
        torch.manual_seed(1)
        with caplog.at_level(logging.INFO, logger="captioner.training.module"):
            trainer.fit(module, DataLoader(data, batch_size=None, collate_fn=lambda batch: batch))
        states.append(module.state_dict())
        assert trainer.callback_metrics["train/reward"] > 0
    for name, value in states[0].items():
        assert_close(states[1][name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert "3 of 3 training steps (100%) replayed the CUDA graph" in caplog.text
    assert "3 of 3 training steps (100%) replayed the SCST step's two CUDA graphs" in caplog.text
    assert isinstance(module.graphed_scst, SelfCriticalSteps) and module.graphed_scst.captures == 1
