"""Self-critical sequence training: the batched policy rollout, the self-critical loss, and SCST runs of
train.py (from a cross-entropy run, resumed, under DDP)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from captioner.config import DecodingConfig, ModelConfig, from_dict
from captioner.data.vocab import END_ID, PAD_ID, Vocabulary
from captioner.errors import ConfigError
from captioner.evaluation.cider import CiderD
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import rollout
from captioner.model.losses import SelfCriticalLoss
from captioner.model.steps import EXIT_CHECK_INTERVAL
from captioner.training.objectives import caption_rewards
from conftest import END, START, TrainedRun, features_for, logged, make_decoder, run_train, tiny_overrides


def teacher_forced_log_probs(
    decoder: ShowAttendTellDecoder, features: torch.Tensor, tokens: torch.Tensor, samples: int
) -> torch.Tensor:
    """log p of each token of ``tokens`` (N, T) under teacher forcing, over the words rollout may draw."""
    captions = torch.cat([torch.full((tokens.size(0), 1), START), tokens], dim=1)  # (N, T+1)
    index = torch.arange(features.size(0)).repeat_interleave(samples)
    logits = decoder(features, captions, index).logits  # (N, T, V)
    logits[..., [PAD_ID, START]] = float("-inf")
    return logits.log_softmax(-1).gather(2, tokens.unsqueeze(2)).squeeze(2)  # (N, T)


def test_rollout_samples_k_captions_per_image_with_their_log_probs() -> None:
    decoder, features = make_decoder().eval(), features_for(3)
    torch.manual_seed(0)
    drawn = rollout(decoder, features, 4, DecodingConfig(max_len=9))
    rows, steps = drawn.tokens.shape
    assert rows == 12 and steps <= 9 and drawn.log_probs.shape == (12, steps) and drawn.lengths.shape == (12,)
    mask = torch.arange(steps) < drawn.lengths.unsqueeze(1)
    assert bool((drawn.tokens[~mask] == PAD_ID).all()) and bool((drawn.log_probs[~mask] == 0).all())
    assert not bool(((drawn.tokens == PAD_ID) | (drawn.tokens == START))[mask].any())
    ended = drawn.lengths < steps
    last = drawn.tokens.gather(1, (drawn.lengths - 1).unsqueeze(1)).squeeze(1)
    assert bool((last[ended] == END).all())
    assert drawn.log_probs.requires_grad
    # each token's log-probability is the policy's for that token given the sampled prefix
    expected = teacher_forced_log_probs(decoder, features, drawn.tokens, 4)
    assert_close(drawn.log_probs[mask], expected[mask], atol=1e-5, rtol=0)
    # the samples of one image differ (it is sampling, not k copies of one caption)
    assert len({tuple(row) for row in drawn.tokens[:4].tolist()}) > 1


def test_rollout_runs_all_samples_at_once_without_host_reads_per_step(monkeypatch: pytest.MonkeyPatch) -> None:
    decoder = make_decoder().eval()
    with torch.no_grad():
        decoder.classifier.bias[END] = float("-inf")  # never ends: every step runs
    steps, reads = [], []
    decoder.lstm.register_forward_hook(lambda module, args, out: steps.append(args[0].shape[0]))

    def counted(name):
        original = getattr(torch.Tensor, name)
        return lambda self, *args: reads.append(name) or original(self, *args)

    for name in ("__bool__", "item", "tolist", "__int__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, counted(name))
    rollout(decoder, features_for(3), 5, DecodingConfig(max_len=12))
    assert steps == [15] * 12  # one decoder step per word for the 3 x 5 captions together
    assert reads == ["__bool__"] * (12 // EXIT_CHECK_INTERVAL)  # only the early-exit checks


def test_hard_attention_rollout_carries_the_sampled_locations_in_the_policy_gradient() -> None:
    decoder, features = make_decoder("hard").train(), features_for(2)
    torch.manual_seed(1)
    drawn = rollout(decoder, features, 3, DecodingConfig(max_len=6))
    drawn.log_probs.sum().backward()
    # a sampled location a_s reaches the words without any gradient to the attention scorer: its
    # gradient comes from log alpha(s), the location's own log-probability
    assert decoder.attention.query.weight.grad.abs().sum() > 0
    decoder.zero_grad()
    drawn = rollout(
        decoder.eval(), features, 3, DecodingConfig(max_len=6)
    )  # eval: the most likely location, no sampling
    drawn.log_probs.sum().backward()
    assert decoder.attention.query.weight.grad is None or decoder.attention.query.weight.grad.abs().sum() == 0


def test_the_cider_d_reward_scores_the_words_without_the_final_end() -> None:
    """SCST's reward leaves the caption's <end> out of its n-grams (coco-caption's convention, not
    self-critical.pytorch's, which scores "<eos>" as a word): a caption that ended and the same words cut off at
    the length limit get the same reward, the words' own CIDEr-D, not that of the words and "<end>"."""
    vocab = Vocabulary(["a", "red", "blue", "circle", "square"])
    references = [[["a", "red", "circle"], ["a", "red", "circle", "and", "a", "square"]], [["a", "blue", "square"]]]
    cider = CiderD(references, words=vocab.itos)
    ids = [vocab.stoi[w] for w in ("a", "red", "circle")]
    tokens = torch.tensor([[*ids, END_ID, PAD_ID], [*ids, END_ID, PAD_ID], [*ids, vocab.stoi["square"], END_ID]])
    lengths = torch.tensor([4, 3, 5])  # with its <end>; cut off after "circle"; four words and <end>
    rewards = caption_rewards(cider, tokens, lengths, torch.tensor([0, 0, 0]), END_ID)  # (3,)
    words = cider.score([["a", "red", "circle"], ["a", "red", "circle", "square"]], [0, 0]).float()
    assert_close(rewards, words[[0, 0, 1]])
    with_end = cider.score([["a", "red", "circle", "<end>"]], [0]).float()
    assert rewards[0] > with_end[0] + 0.5, (rewards, with_end)


def test_self_critical_gradient_raises_samples_above_the_baseline_and_lowers_those_below() -> None:
    log_probs = torch.zeros(6, 3, requires_grad=True)  # 2 images x 3 samples, 3 steps
    lengths = torch.tensor([3, 3, 3, 2, 3, 1])
    rewards = torch.tensor([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0]])
    terms = SelfCriticalLoss("mean")(log_probs, lengths, rewards)
    terms["loss"].backward()
    # advantages: r_i minus the mean of the image's other samples
    advantage = torch.tensor([0.75, -0.75, 0.0, 0.0, 0.0, 0.0])
    mask = (torch.arange(3) < lengths.unsqueeze(1)).float()
    assert_close(log_probs.grad, -advantage.unsqueeze(1) * mask / mask.sum())
    assert terms.keys() == {"loss", "reward"} and terms["reward"].item() == pytest.approx(7.5 / 6)

    log_probs.grad = None
    terms = SelfCriticalLoss("greedy")(log_probs, lengths, rewards, greedy_rewards=torch.tensor([0.5, 3.0]))
    terms["loss"].backward()
    assert terms["greedy_reward"].item() == pytest.approx(1.75)
    advantage = torch.tensor([0.5, -0.5, 0.0, -1.0, -1.0, -1.0])  # r_i minus the greedy caption's reward
    assert_close(log_probs.grad, -advantage.unsqueeze(1) * mask / mask.sum())
    with pytest.raises(ValueError, match="greedy captions' rewards"):
        SelfCriticalLoss("greedy")(log_probs, lengths, rewards)
    with pytest.raises(ValueError, match="samples >= 2"):
        SelfCriticalLoss("mean")(log_probs[:2], lengths[:2], rewards[:, :1])
    with pytest.raises(ConfigError, match="baseline='best' is not valid"):
        SelfCriticalLoss("best")


@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_one_self_critical_step_makes_the_better_sample_likelier_and_the_worse_less_likely(mode: str) -> None:
    decoder, features = make_decoder(mode, seed=3).train(), features_for(1, seed=3)
    torch.manual_seed(4)
    drawn = rollout(decoder, features, 2, DecodingConfig(max_len=6))
    assert not torch.equal(drawn.tokens[0], drawn.tokens[1])
    decoder.eval()  # scored without location sampling: the words' probabilities alone
    before = teacher_forced_log_probs(decoder, features, drawn.tokens, 2).detach()
    mask = torch.arange(drawn.tokens.size(1)) < drawn.lengths.unsqueeze(1)
    optimizer = torch.optim.SGD(decoder.parameters(), lr=0.5)
    loss = SelfCriticalLoss("mean")(drawn.log_probs, drawn.lengths, torch.tensor([[1.0, 0.0]]))["loss"]
    loss.backward()
    optimizer.step()
    after = teacher_forced_log_probs(decoder, features, drawn.tokens, 2).detach()
    gain = ((after - before) * mask).sum(dim=1)  # change of log p(caption)
    assert gain[0] > 0 > gain[1]


# -------------------------------------------------------------------------------------- SCST training
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_self_critical_training_raises_the_greedy_captions_cider(attention: str) -> None:
    """The module's SCST step, from random weights on 8 toy images: greedy CIDEr-D rises far above where
    it started (every caption draws its reward from the image's own references). Hard attention learns
    through the same policy gradient, its sampled locations included."""
    from captioner.data.vocab import Vocabulary
    from captioner.evaluation.cider import CiderD
    from captioner.training.module import CaptionerModule

    vocab = Vocabulary([f"w{i}" for i in range(10)])
    references = [
        [[f"w{(i + j) % 10}" for j in range(3)], [f"w{(i + j) % 10}" for j in range(4)]] for i in range(8)
    ]  # image i: "w_i w_i+1 w_i+2" and one word longer
    torch.manual_seed(0)
    module = CaptionerModule(
        vocab,
        from_dict(
            ModelConfig,
            dict(
                attention=attention,
                encoder={"name": "resnet18", "weights": None, "stage": "layer1", "grid": 2},
                feature_norm=True,
                decoder={"embed_dim": 16, "hidden_dim": 32, "attention_dim": 16, "dropout": 0.0},
                decoding={"max_len": 6},
                objective="scst",
            ),
        ),
    )
    module.cider = CiderD(references, words=vocab.itos)
    features = torch.randn(8, 4, module.model.encoder.out_channels)
    batch = {"features": features, "indices": torch.arange(8)}

    def greedy_cider() -> float:
        module.eval()
        generation, _ = module.model.generate_from_features(
            features, decoding=DecodingConfig(method="greedy", max_len=6)
        )
        module.train()
        return module.cider.score([vocab.decode(row) for row in generation.tokens.tolist()], range(8)).mean().item()

    before = greedy_cider()
    optimizer = torch.optim.Adam(module.parameters(), lr=3e-3)
    rewards = []
    for _ in range(120):
        terms = module.self_critical_terms(batch)
        optimizer.zero_grad()
        terms["loss"].backward()
        optimizer.step()
        rewards.append(terms["reward"].item())
    after = greedy_cider()
    assert sum(rewards[-10:]) / 10 > sum(rewards[:10]) / 10 + 2.0, rewards
    assert after > before + 2.5


# ------------------------------------------------------------------------------ SCST runs of train.py
@pytest.mark.slow
def test_scst_from_a_cross_entropy_run_learns_and_resumes_under_ddp(
    trained_run: TrainedRun, tiny_shapes: Path, tmp_path: Path
) -> None:
    ce_run = trained_run.folder  # the cross-entropy run SCST starts from
    # save_top_k=-1: Lightning 2.6 rewrites last.ckpt at a validation only when it saves a top-k checkpoint
    base = [
        *tiny_overrides(tiny_shapes, tmp_path, cache=trained_run.cache),
        "experiment=demo_scst",
        "test=false",
        "callbacks.early_stopping=null",
        "callbacks.model_checkpoint.save_top_k=-1",
        "trainer.log_every_n_steps=1",
    ]
    first = run_train([*base, f"ckpt_path={ce_run}", "trainer.max_epochs=2", f"hydra.run.dir={tmp_path / 'scst'}"])
    assert f"starting from the weights of {ce_run / 'bundle.pt'}" in first.stdout
    assert "CIDEr-D" in first.stdout
    rewards = list(logged(tmp_path / "scst", "train/reward").values())  # the samples' mean CIDEr-D per step
    assert len(rewards) == 30 and sum(rewards[-10:]) > sum(rewards[:10]), rewards
    assert logged(tmp_path / "scst", "val/cider") and logged(ce_run, "val/cider")
    last = torch.load(tmp_path / "scst" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["hyper_parameters"]["objective"] == "scst" and last["epoch"] == 1
    assert "cider" in next((tmp_path / "scst" / "checkpoints").glob("epoch*.ckpt")).name
    # resumed from its last.ckpt by two processes: each samples and scores its half of the 240 images
    resumed = run_train(
        [
            *base,
            f"ckpt_path={tmp_path / 'scst'}",
            "trainer.max_epochs=3",
            "trainer=ddp_cpu",
            "trainer.devices=2",
            f"hydra.run.dir={tmp_path / 'ddp'}",
        ]
    )
    assert f"resuming {tmp_path / 'scst' / 'checkpoints' / 'last.ckpt'}" in resumed.stdout
    carried = [path.name for path in (tmp_path / "ddp" / "checkpoints").glob("epoch00[01]*.ckpt")]
    assert carried == [
        Path(last["callbacks"][key]["best_model_path"]).name
        for key in last["callbacks"]
        if key.startswith("BestCheckpoint")
    ]  # save_top_k=-1: of the earlier epochs only the best
    ddp = torch.load(tmp_path / "ddp" / "checkpoints" / "last.ckpt", weights_only=True)
    assert ddp["epoch"] == 2 and ddp["global_step"] == last["global_step"] + math.ceil(120 / 16)
    assert json.loads((tmp_path / "ddp" / "metrics.json").read_text())["final/val/cider"] > 0


@pytest.mark.slow
def test_scst_after_cross_entropy_epochs_in_one_run(tiny_shapes: Path, tmp_path: Path) -> None:
    """objective=scst with scst.after_epochs=1, from scratch: epoch 0 trains with cross-entropy, epoch 1
    with SCST (its reward logged); the checkpoints say objective scst, so ckpt_path=<this run> resumes it."""
    steps_per_epoch = 4  # of the 15 batches of 16 images: what the switch needs
    run = run_train(
        [
            *tiny_overrides(tiny_shapes, tmp_path, cache=tmp_path / "cache"),
            "model.objective=scst",
            "model.scst.after_epochs=1",
            "trainer.max_epochs=2",
            f"+trainer.limit_train_batches={steps_per_epoch}",
            "test=false",
            "trainer.log_every_n_steps=1",
        ]
    )
    assert "epoch 1: self-critical training (CIDEr-D reward) takes over from cross-entropy" in run.stdout
    cross_entropy, rewards = logged(tmp_path / "run", "train/ce"), logged(tmp_path / "run", "train/reward")
    assert sorted(cross_entropy) == list(range(steps_per_epoch))
    assert sorted(rewards) == list(range(steps_per_epoch, 2 * steps_per_epoch))
    last = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True)
    assert last["hyper_parameters"]["objective"] == "scst"
