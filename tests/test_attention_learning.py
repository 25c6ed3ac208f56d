"""Attention learns where to look: on synthetic images where one cell holds the caption's word, training moves
alpha onto that cell, with soft attention and with hard attention under each estimator (the paper's REINFORCE
through CaptionLoss, and straight-through Gumbel-softmax).

Hard attention is trained with ``hard_expectation_prob=0``: every step reads one sampled location, so the
cross-entropy has no path to alpha and the attention learns from its estimator alone (REINFORCE's
(r_t - b_t) grad log alpha_{s_t}, or the relaxed one-hot's straight-through gradient). The doubly stochastic
penalty is off (``ds_lambda=0``): it asks every location to be read about once over a caption, which over a
two-step caption and 16 locations pulls alpha towards uniform, against what is tested here (with the default
1.0, seeds 0-4 end at alpha mass 0.25-0.27 soft, 0.12-0.16 REINFORCE, 0.03-0.17 Gumbel). Every other
CaptionLoss setting is the project's default.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from captioner.config import LossConfig
from captioner.data.vocab import END_ID, PAD_ID, START_ID, UNK_ID
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.losses import CaptionLoss
from conftest import net_config

L, D, K = 16, 16, 4  # locations, feature channels, object words
PAD, START, END, UNK = PAD_ID, START_ID, END_ID, UNK_ID
NOTHING = 4 + K  # the word of an image with no object; ids 4 .. 4 + K - 1, after the specials, name the objects
V = NOTHING + 1
EMPTY = 0.2  # share of images with no object
STEPS, BATCH, LR = 300, 256, 3e-3


@dataclass
class Scenes:
    """Images of L background cells N(0, 0.5^2), of which one at a random place holds an object: a marker
    shared by all objects (what stands out, as an object does against background) plus the object word's
    embedding. The marker has twice a background cell's norm, the embeddings about the same norm.

    A fifth of the images have no object and read "nothing": otherwise, once K - 1 objects are found, the
    last one is told by elimination and training may stop short of it (seeds 0-9 with no empty images: alpha
    mass 0.73-0.79 on 5 for soft, 0.75 on 2 for Gumbel, 0.83-0.89 on 2 for REINFORCE, every accuracy 1.00).
    What the mean feature (h_0, a uniform read) tells of the word: ``test_without_attention_accuracy_stays_low``.
    """

    generator: torch.Generator
    marker: Tensor  # (D,), norm sqrt(D)
    embeddings: Tensor  # (K, D)

    @classmethod
    def seeded(cls, seed: int) -> Scenes:
        generator = torch.Generator().manual_seed(seed)
        marker = torch.randn(D, generator=generator)
        embeddings = 0.5 * torch.randn(K, D, generator=generator)
        return cls(generator, marker / marker.norm() * D**0.5, embeddings)

    def sample(self, n: int) -> tuple[Tensor, Tensor, Tensor]:
        """Features (n, L, D), captions (n, 3) ``<start> word <end>`` and the object's cell (n,), -1 for none."""
        objects = torch.randint(0, K, (n,), generator=self.generator)
        cells = torch.randint(0, L, (n,), generator=self.generator)
        empty = torch.rand(n, generator=self.generator) < EMPTY
        features = 0.5 * torch.randn(n, L, D, generator=self.generator)
        rows = torch.arange(n)[~empty]
        features[rows, cells[~empty]] = self.marker + self.embeddings[objects[~empty]]
        words = torch.where(empty, NOTHING, 4 + objects)
        captions = torch.stack([torch.full_like(words, START), words, torch.full_like(words, END)], dim=1)
        return features, captions, cells.masked_fill(empty, -1)


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """These tiny steps run faster on one thread; two threads on two shared cores can spin for minutes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_decoder(seed: int, **options: Any) -> ShowAttendTellDecoder:
    torch.manual_seed(seed)
    settings = net_config(embed_dim=16, hidden_dim=32, attention_dim=32, dropout=0.0, **options)
    return ShowAttendTellDecoder(V, D, settings)


def train(decoder: ShowAttendTellDecoder, scenes: Scenes, steps: int = STEPS) -> None:
    """Adam on CaptionLoss over fresh batches, annealing the Gumbel temperature as CaptionerModule does."""
    criterion = CaptionLoss(LossConfig(ds_lambda=0.0), PAD, UNK).train()
    optimizer = torch.optim.Adam(decoder.parameters(), lr=LR)
    decoder.train()
    for step in range(steps):
        decoder.anneal(step / steps)
        features, captions, _ = scenes.sample(BATCH)
        loss = criterion(decoder(features, captions), captions)["loss"]
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@torch.no_grad()
def evaluate(decoder: ShowAttendTellDecoder, features: Tensor, captions: Tensor, cells: Tensor) -> tuple[float, float]:
    """Mean alpha on the object's cell at the word's step (over the images with an object), and the share of
    all images whose first word, from the decoder in evaluation mode (hard: reading the argmax location), is
    right."""
    decoder.eval()
    output = decoder(features, captions)
    found = cells >= 0
    mass = output.alphas[found, 0, cells[found]].mean()
    accuracy = (output.logits[:, 0].argmax(dim=-1) == captions[:, 1]).float().mean()
    return mass.item(), accuracy.item()


def attention_before_and_after(seed: int, **options: Any) -> tuple[tuple[float, float], tuple[float, float]]:
    """(alpha mass, accuracy) on 1000 held-out images before and after training a decoder built with
    ``options``."""
    scenes = Scenes.seeded(seed)
    held_out = scenes.sample(1000)
    decoder = make_decoder(seed, **options)
    before = evaluate(decoder, *held_out)
    train(decoder, scenes)
    return before, evaluate(decoder, *held_out)


ESTIMATORS: dict[str, dict[str, Any]] = {
    "soft": {"attention": "soft"},
    "reinforce": {"attention": "hard", "hard_estimator": "reinforce", "hard_expectation_prob": 0.0},
    "gumbel": {"attention": "hard", "hard_estimator": "gumbel", "hard_expectation_prob": 0.0},
}


@pytest.mark.parametrize("options", ESTIMATORS.values(), ids=ESTIMATORS.keys())
def test_training_moves_the_attention_onto_the_informative_cell(options: dict[str, Any]) -> None:
    """At init alpha is about uniform (1/16 = 0.06); after 300 steps nearly all of it is on the object.

    Observed over seeds 0-39: alpha mass 0.035-0.093 before training; after it, mass / accuracy 0.92-1.00 /
    1.00 for soft, 1.00 / 1.00 for REINFORCE and Gumbel; 0.50-0.60 accuracy without attention (test below).
    """
    (mass_before, _), (mass, accuracy) = attention_before_and_after(0, **options)
    assert abs(mass_before - 1 / L) < 0.5 / L
    assert mass > 0.8
    assert accuracy > 0.9


def test_without_attention_accuracy_stays_low() -> None:
    """The same training with alpha fixed at 1/L (scorer "mean": every step reads the mean feature) leaves
    the word to what the mean tells of it: the accuracy above needs the object's cell."""
    _, (mass, accuracy) = attention_before_and_after(0, scorer="mean")
    assert mass == pytest.approx(1 / L)
    assert accuracy < 0.7
