"""Teacher forcing in the (B, K) layout (``image_index`` = K captions per image, each image's features read
once for its K captions) equals the gathered layout (``image_index`` a tensor, the features copied to every
caption): outputs, loss and every gradient, for soft and hard attention (the same samples under one seed),
with dropout; and the batches collate builds say when every image has the same K."""

from __future__ import annotations

import pytest
import torch

from captioner.data.dataset import collate
from captioner.model.decoder import ShowAttendTellDecoder
from conftest import D, V, features_for, make_loss, net_config

IMAGES, PER_IMAGE, STEPS = 4, 3, 6
MODES = {
    "soft": {},
    "soft, dropout": {"dropout": 0.3},
    "hard REINFORCE": {"attention": "hard", "hard_expectation_prob": 0.5, "dropout": 0.3},
    "hard Gumbel": {"attention": "hard", "hard_estimator": "gumbel", "hard_expectation_prob": 0.5},
    "multihead": {"scorer": "multihead", "attention_heads": 2},
}


def decoder_for(options: dict) -> ShowAttendTellDecoder:
    """A seeded 16-wide decoder in training mode with ``options`` (``net_config``'s)."""
    torch.manual_seed(0)
    settings = net_config(**{"embed_dim": 16, "hidden_dim": 16, "attention_dim": 16, "dropout": 0.0, **options})
    return ShowAttendTellDecoder(V, D, settings).train()


def teacher_forced(decoder: ShowAttendTellDecoder, image_index: torch.Tensor | int, seed: int) -> tuple:
    """The outputs, loss terms and gradients (parameters' and the features') of one seeded step."""
    features = features_for(IMAGES).requires_grad_()
    generator = torch.Generator().manual_seed(5)
    captions = torch.randint(4, V, (IMAGES * PER_IMAGE, STEPS + 1), generator=generator)
    captions[:, 0] = 1
    captions[::2, -2:] = 0  # some pad steps
    decoder.zero_grad()
    torch.manual_seed(seed)
    output = decoder(features, captions, image_index)
    terms = make_loss(pad_id=0)(output, captions)
    terms["loss"].backward()
    grads = {name: p.grad.clone() for name, p in decoder.named_parameters() if p.grad is not None}
    return output, terms, {**grads, "features": features.grad}


@pytest.mark.parametrize("mode", MODES)
def test_k_captions_per_image_equal_the_gathered_captions(mode):
    decoder = decoder_for(MODES[mode])
    index = torch.arange(IMAGES).repeat_interleave(PER_IMAGE)
    for seed in range(3):
        gathered, gathered_terms, gathered_grads = teacher_forced(decoder, index, seed)
        grouped, grouped_terms, grouped_grads = teacher_forced(decoder, PER_IMAGE, seed)
        assert grouped.logits.shape == (IMAGES * PER_IMAGE, STEPS, V)
        for field in ("logits", "alphas", "location_log_probs", "entropy", "sampled"):
            mine, theirs = getattr(grouped, field), getattr(gathered, field)
            assert (mine is None) == (theirs is None), field
            if mine is not None:
                torch.testing.assert_close(mine, theirs, msg=field)
        if decoder.mode == "hard":  # the same images read the expectation, the others the same locations
            assert 0 < int(grouped.sampled.sum()) < IMAGES * PER_IMAGE
            assert grouped.sampled.view(IMAGES, PER_IMAGE).all(1).equal(grouped.sampled.view(IMAGES, PER_IMAGE).any(1))
        assert gathered_terms.keys() == grouped_terms.keys()
        for key, value in gathered_terms.items():
            torch.testing.assert_close(grouped_terms[key], value, msg=key)
        assert gathered_grads.keys() == grouped_grads.keys()
        for name, grad in gathered_grads.items():
            torch.testing.assert_close(grouped_grads[name], grad, msg=name)


def test_one_caption_per_image_is_the_plain_layout():
    decoder = decoder_for({})
    features = features_for(IMAGES)
    captions = torch.randint(4, V, (IMAGES, STEPS + 1), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(decoder(features, captions, 1).logits, decoder(features, captions).logits)


def item(captions: int) -> dict:
    """A dataset item with ``captions`` captions of three tokens."""
    return {"image": torch.zeros(3, 2, 2), "captions": [torch.tensor([1, 5, 2])] * captions, "image_id": 0, "index": 0}


def test_collate_names_the_captions_per_image_when_every_image_has_as_many():
    assert collate([item(5), item(5)])["captions_per_image"] == 5
    assert collate([item(5), item(6)])["captions_per_image"] is None
    assert collate([item(1)])["captions_per_image"] == 1
