"""Static shapes (every step of max_len run, nothing read back from the device, as CUDA graphs need): the same
captions, scores and alphas as the early-exit loop for every method, and the same rollout samples padded to
max_len; on by default on CUDA only."""

import pytest
import torch

from captioner.config import DecodingConfig
from captioner.model import decoding
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import sample
from captioner.model.steps import EXIT_CHECK_INTERVAL, static_steps
from conftest import END, features_for, make_decoder
from decoding_helpers import METHODS, with_end_bias


class EndsAtItsStep(torch.nn.Module):
    """A real decoder whose <end> logit is pushed down before, and up from, step 2 + (b mod 5) of image b:
    the images of a batch finish at different steps. The step counter and the target ride in the state,
    so beams and samples carry them like h and c."""

    def __init__(self, decoder: ShowAttendTellDecoder) -> None:
        super().__init__()
        self.inner, self.attention = decoder, decoder.attention

    def init_state(self, features):
        targets = 2.0 + torch.arange(features.size(0)) % 5  # (B,)
        return (*self.inner.init_state(features), torch.stack([torch.zeros_like(targets), targets], dim=1))

    def step(self, tokens, state, features, keys):
        h, c, clock = state  # clock (..., 2): steps taken, target
        logits, (h, c), alpha, log_prob, entropy = self.inner.step(tokens, (h, c), features, keys)
        clock = clock + torch.tensor([1.0, 0.0])
        push = torch.where(clock[..., 0] > clock[..., 1], 4.0, -4.0)  # (...,)
        logits = logits + torch.nn.functional.one_hot(torch.tensor(END), logits.size(-1)) * push.unsqueeze(-1)
        return logits, (h, c, clock), alpha, log_prob, entropy


def _run(method: str, decoder, features, static: bool, **options) -> decoding.Generation:
    if method == "sample":
        return sample(
            decoder, features, DecodingConfig(max_len=16, **options), torch.Generator().manual_seed(3), None, static
        )
    if method.startswith("beam"):
        options["beam_size"] = int(method[4:])
        method = "beam"
    return METHODS[method](decoder, features, DecodingConfig(max_len=16, **options), static_shapes=static)


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("method", ["greedy", "sample", "beam1", "beam3", "beam5"])
@pytest.mark.parametrize("batch", [1, 6])
def test_static_shapes_give_the_captions_scores_and_alphas_of_the_early_exit(mode, method, batch):
    decoder = EndsAtItsStep(make_decoder(mode, seed=4))  # captions of several lengths, all well under 16
    features = features_for(batch, seed=5)
    options = dict(length_penalty=0.7) if method.startswith("beam") else {}
    dynamic = _run(method, decoder, features, False, **options)
    static = _run(method, decoder, features, True, **options)
    if batch > 1:
        assert dynamic.lengths.unique().numel() > 1  # the images finish at different steps
    assert int(dynamic.lengths.max()) < 12  # so the dynamic loop stopped early
    assert torch.equal(static.tokens, dynamic.tokens) and torch.equal(static.lengths, dynamic.lengths)
    assert torch.equal(static.scores, dynamic.scores)
    assert torch.equal(static.alphas, dynamic.alphas)


def test_static_shapes_run_every_step_without_reading_the_device(monkeypatch):
    decoder = with_end_bias(make_decoder(seed=8), 3.0)  # every caption ends at once
    steps, reads = [], []
    decoder.lstm.register_forward_hook(lambda m, args, out: steps.append(1))
    original = torch.Tensor.__bool__
    monkeypatch.setattr(torch.Tensor, "__bool__", lambda self: reads.append(1) or original(self))
    for run in METHODS.values():
        steps.clear(), reads.clear()
        run(decoder, features_for(3), DecodingConfig(max_len=12), static_shapes=True)
        assert len(steps) == 12 and reads == [], run.__name__
        steps.clear()
        run(decoder, features_for(3), DecodingConfig(max_len=12), static_shapes=False)
        assert len(steps) == EXIT_CHECK_INTERVAL, run.__name__


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_static_rollout_gives_the_early_exit_samples_padded_to_max_len(mode):
    decoder = EndsAtItsStep(make_decoder(mode, seed=6).train())  # hard attention samples locations too
    draws = []
    for static in (False, True):
        torch.manual_seed(0)
        draws.append(
            decoding.rollout(
                decoder,
                features_for(4),
                3,
                DecodingConfig(max_len=16),
                torch.Generator().manual_seed(1),
                static_shapes=static,
            )
        )
    dynamic, static = draws
    width = dynamic.tokens.size(1)
    assert width < 16 and static.tokens.shape == (12, 16) and dynamic.lengths.unique().numel() > 1
    assert torch.equal(static.tokens[:, :width], dynamic.tokens) and not static.tokens[:, width:].any()
    assert torch.equal(static.lengths, dynamic.lengths)
    assert torch.equal(static.log_probs[:, :width], dynamic.log_probs) and not static.log_probs[:, width:].any()


def test_static_shapes_default_to_cuda_only():
    assert decoding.ModelConfig().static_shapes is None
    assert static_steps(None, torch.zeros(1)) is False
    assert static_steps(None, torch.zeros(1, device="meta")) is False
    assert static_steps(True, torch.zeros(1)) is True
