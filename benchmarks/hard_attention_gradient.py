"""Does hard attention's gradient carry signal? Split-half agreement and size of each estimator's gradient.

On one training batch of the built-in demo (the config ``python train.py`` composes, any overrides
appended), the same model's attention parameters receive a gradient from each estimator of hard
attention, resampled many times:

- ``sequence``: REINFORCE with the whole caption's log-likelihood as every step's reward and one
  batch-mean baseline (what this project did before, and what most reimplementations do);
- ``word`` and ``suffix``: REINFORCE with a per-step reward (log p of word t, or of words t..end) and
  a per-step baseline (``model.loss.reinforce_reward``);
- ``gumbel``: the straight-through Gumbel-softmax estimator (``model.decoder.hard_estimator=gumbel``),
  whose gradient is the cross-entropy's through the relaxed one-hot.

For each it prints the cosine between the mean gradients of two independent halves of the resamples (1:
every resample points the same way; 0: noise), and the norm of one resample's gradient relative to
the cross-entropy's gradient on the same parameters under soft attention (the scale the optimiser sees
next to the expected-context images). REINFORCE norms are given at weight 1 and at the configured
``model.loss.reinforce_weight``::

    python benchmarks/hard_attention_gradient.py                      # fresh model, 40 resamples
    python benchmarks/hard_attention_gradient.py --resamples 80 model.decoder.embed_dim=256
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
from hydra.utils import instantiate
from torch import Tensor

import composed
from captioner.config import Attention, HardEstimator, LossConfig, TrainConfig, from_dict
from captioner.model.decoder import DecoderOutput
from captioner.model.losses import CaptionLoss
from captioner.training.datamodule import CaptionDataModule
from captioner.training.module import CaptionerModule
from captioner.training.objectives import cached_features

ESTIMATORS = ("sequence", "word", "suffix", "gumbel")


def demo_batch(overrides: list[str]) -> tuple[object, dict]:
    """The CaptionerModule and the first training batch of the demo, built as ``train.py`` builds them,
    with the batch's grid features computed once under ``batch["features"]``."""
    cfg = composed.compose_config("demo", ["model=hard", *overrides, "data.feature_cache=null"])
    settings = from_dict(TrainConfig, cfg)
    datamodule = CaptionDataModule(instantiate(cfg["data"]["source"]), settings.data)
    datamodule.setup("fit")
    module = CaptionerModule(datamodule.vocab, settings.model)
    batch = next(iter(datamodule.train_dataloader()))
    module.model.encoder.eval()
    with torch.no_grad():
        batch["features"], _ = module.model.encode(batch["images"])  # (B, L, C)
    return module, batch


def flat_attention_gradient(module, loss: Tensor) -> Tensor:
    """The gradient of ``loss`` on the decoder's attention parameters, flattened."""
    params = list(module.model.decoder.attention.parameters())
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return torch.cat([(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)])


def estimator_loss(name: str, output: DecoderOutput, captions: Tensor, criterion: CaptionLoss) -> Tensor:
    """The term whose gradient is the estimator ``name``'s (REINFORCE at weight 1)."""
    if name == "gumbel":
        return criterion(output, captions)["ce"]
    if name in ("word", "suffix"):
        return criterion(output, captions)["reinforce"]
    mask = (captions[:, 1:] != criterion.pad_id).to(output.logits.dtype)  # "sequence": one reward per caption
    log_lik = output.logits.log_softmax(-1).gather(-1, captions[:, 1:].unsqueeze(-1)).squeeze(-1).detach()
    sequence = (log_lik * mask).sum(1)  # (N,) log p(y | s)
    advantage = sequence - sequence.mean()
    location = (output.location_log_probs * mask).sum(1)  # (N,) log p(s | a)
    return -(advantage * location).sum() / mask.sum()


def measure(module, batch: dict, name: str, resamples: int) -> tuple[float, float]:
    """(split-half cosine, mean norm of one resample's gradient) for estimator ``name``."""
    decoder = module.model.decoder
    decoder.hard_estimator = HardEstimator.gumbel if name == "gumbel" else HardEstimator.reinforce
    settings = LossConfig(
        ds_lambda=0.0,
        reinforce_weight=1.0,
        reinforce_reward="suffix" if name == "suffix" else "word",
        entropy_weight=0.0,
    )
    criterion = CaptionLoss(settings, module.criterion.pad_id, module.criterion.unk_id).train()
    features = cached_features(batch, module.dtype)
    gradients = []
    for _ in range(resamples):
        output = module.model.forward_features(features, batch["captions"], batch["image_index"])
        gradients.append(flat_attention_gradient(module, estimator_loss(name, output, batch["captions"], criterion)))
    half = resamples // 2
    first, second = torch.stack(gradients[:half]).mean(0), torch.stack(gradients[half:]).mean(0)
    cosine = float(torch.nn.functional.cosine_similarity(first, second, dim=0))
    return cosine, float(torch.stack(gradients).norm(dim=1).mean())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resamples", type=int, default=40, help="resamples per estimator, split in two halves")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides of the demo config (model=hard is set)")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    module, batch = demo_batch(args.overrides)
    module.train()
    module.model.decoder.hard_expectation_prob = 0.0  # every caption samples: the estimator alone
    module.model.decoder.dropout.p = 0.0
    weight = module.criterion.reinforce_weight

    decoder = module.model.decoder
    decoder.mode = Attention.soft
    features = cached_features(batch, module.dtype)
    output = module.model.forward_features(features, batch["captions"], batch["image_index"])
    reference = float(flat_attention_gradient(module, module.criterion(output, batch["captions"])["ce"]).norm())
    decoder.mode = Attention.hard

    images, captions = batch["image_index"].max().item() + 1, batch["captions"].shape[0]
    print(
        f"one demo batch: {images} images, {captions} captions; {args.resamples} resamples per estimator; "
        f"attention parameters' cross-entropy gradient norm under soft attention: {reference:.3g}"
    )
    print(
        f"\n| estimator | split-half cosine | gradient norm / cross-entropy's (weight 1) "
        f"| at reinforce_weight={weight:g} |"
    )
    print("|---|---|---|---|")
    for name in ESTIMATORS:
        cosine, norm = measure(module, batch, name, args.resamples)
        scaled = norm / reference * (1.0 if name == "gumbel" else weight)
        print(f"| {name} | {cosine:.2f} | {norm / reference:.3g} | {scaled:.3g} |")
    if math.isnan(reference):
        sys.exit("the cross-entropy gradient is not finite")


if __name__ == "__main__":
    main()
