"""LightningModule: the captioning losses, optimisers and a validation that really decodes.

Training optimises cross-entropy (``objective=cross_entropy``) or fine-tunes a trained model with
self-critical sequence training (``objective=scst``: CIDEr-D of sampled captions as the reward).
Validation never teacher-forces BLEU: it decodes (greedy or beam), gathers the captions of every rank,
counts each image once and scores them against all references with nltk's corpus BLEU and CIDEr-D.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from captioner.bundle import CHECKPOINT_KEY, bundle_layout, bundle_metadata, save_bundle
from captioner.config import (
    ModelConfig,
    NonFinite,
    Objective,
    Schedule,
    ScstBaseline,
    from_dict,
    to_dict,
)
from captioner.data.dataset import SkipCounter
from captioner.data.vocab import Vocabulary
from captioner.errors import CaptionerError
from captioner.evaluation.bleu import corpus_bleu_scores
from captioner.evaluation.cider import CiderD, corpus_cider_d
from captioner.evaluation.correctness import AttentionCorrectness
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.decoding import Generation, greedy, rollout
from captioner.model.losses import CaptionLoss, SelfCriticalLoss

log = logging.getLogger(__name__)


class NonFiniteLossError(CaptionerError):
    """The training loss became NaN or infinite."""


class CaptionerModule(L.LightningModule):
    """Show, Attend and Tell training: masked cross-entropy + doubly stochastic (+ REINFORCE for hard), or
    self-critical sequence training of a trained model (``objective="scst"``, settings in ``scst``)."""

    def __init__(self, vocab: Vocabulary, **settings: Any) -> None:
        """``settings``: the ``model`` config's keys (``captioner.config.ModelConfig``'s fields, plain or typed);
        ConfigError names a bad one."""
        super().__init__()
        self.settings = from_dict(ModelConfig, {k: v for k, v in settings.items() if k != "_target_"}, "model")
        self.save_hyperparameters(to_dict(self.settings))  # every setting, as plain data (weights_only loads it)
        self.vocab = vocab
        self.net_config = bundle_layout(self.settings.net())
        self.model: Captioner = build_captioner(self.settings.net(), len(vocab))
        self.criterion = CaptionLoss(self.settings.loss, vocab.pad_id, vocab.unk_id)
        self.self_critical = SelfCriticalLoss(self.settings.scst.baseline)
        self.cider: CiderD | None = None  # the SCST reward: CIDEr-D against the training references
        self._unchecked: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (epoch, step, loss, non-finite)
        self._step_nonfinite: torch.Tensor | None = None  # whether the coming optimiser step must be skipped
        self.skips = SkipCounter()
        self._skips_reported = 0
        self._predictions: dict[int, list[str]] = {}
        self.predictions: dict[str, dict[int, list[str]]] = {}  # split -> image id -> words, all ranks
        self._correctness = AttentionCorrectness()

    # ----------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        """Compile the decoder step when asked (``model.compile=true``)."""
        if self.settings.compile and stage == "fit":
            self.model.decoder = torch.compile(self.model.decoder)

    def _features(self, batch: dict) -> torch.Tensor:
        """Cached features (B, L, C), stored in fp16, cast on the device to the model's dtype."""
        return batch["features"].to(self.dtype)

    def _forward(self, batch: dict) -> Any:
        captions, index = batch["captions"], batch["image_index"]
        if "features" in batch:
            return self.model.forward_features(self._features(batch), captions, index)
        return self.model(batch["images"], captions, index)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        """One step over a batch of images with all their captions."""
        self.skips.add(batch["skipped"])
        if batch["captions"].numel() == 0:
            return None
        self.model.decoder.anneal(self.global_step / max(1, int(self.trainer.estimated_stepping_batches)))
        if self.scst_epoch:
            terms = self.self_critical_terms(batch)
        else:
            terms = self.criterion(self._forward(batch), batch["captions"])
        loss = terms["loss"]
        self._watch(loss)
        size = batch["captions"].shape[0]
        self.log_dict({f"train/{k}": v.detach() for k, v in terms.items() if k != "loss"}, batch_size=size)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=size)
        return loss

    @property
    def scst_epoch(self) -> bool:
        """Whether this epoch trains with SCST (objective=scst, after ``scst.after_epochs`` cross-entropy epochs)."""
        scst = self.settings.scst
        return self.settings.objective == Objective.scst and self.current_epoch >= scst.after_epochs

    def on_train_epoch_start(self) -> None:
        """Say when self-critical training takes over from cross-entropy in the run."""
        if self.scst_epoch and self.current_epoch == self.settings.scst.after_epochs > 0:
            log.info(
                "epoch %d: self-critical training (CIDEr-D reward) takes over from cross-entropy", self.current_epoch
            )

    def on_fit_start(self) -> None:
        """SCST: CIDEr-D's document frequencies and reference vectors of the training split, built once
        on this rank's device (every rank holds the whole table and scores its own shard's samples)."""
        if self.settings.objective == Objective.scst:
            references = self.trainer.datamodule.references("train")  # in the order of batch["indices"]
            self.cider = CiderD(list(references.values()), words=self.vocab.itos, device=self.device)

    def self_critical_terms(self, batch: dict) -> dict[str, torch.Tensor]:
        """SCST loss terms of a batch: k captions sampled per image, scored by CIDEr-D against its references
        (``self.cider``, rows ``batch["indices"]``)."""
        encoded = (self._features(batch),) if "features" in batch else self.model.encode(batch["images"])
        features = self.model.attend_grid(*self.model.finish_encoding(*encoded))  # (B, L, C)
        samples, images = self.settings.scst.samples, batch["indices"]  # images: rows of the reward's corpus
        ids = dict(
            max_len=self.settings.decoding.max_len,
            start_id=self.vocab.start_id,
            end_id=self.vocab.end_id,
            unk_id=self.vocab.unk_id,
        )
        drawn = rollout(self.model.decoder, features, samples, **ids)
        rewards = self._rewards(drawn.tokens, drawn.lengths, images.repeat_interleave(samples))
        greedy_rewards = None
        if self.settings.scst.baseline == ScstBaseline.greedy:
            self.model.decoder.eval()  # no dropout; hard attention takes the most likely location
            try:
                best = greedy(self.model.decoder, features.detach(), **ids)
            finally:
                self.model.decoder.train()
            greedy_rewards = self._rewards(best.tokens, best.lengths, images)
        return self.self_critical(drawn.log_probs, drawn.lengths, rewards.view(-1, samples), greedy_rewards)

    def _rewards(self, tokens: torch.Tensor, lengths: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
        """CIDEr-D (N,) of captions (N, T) with ``lengths`` counting a final <end>, against corpus ``images``."""
        last = tokens.gather(1, (lengths - 1).clamp_min(0).unsqueeze(1)).squeeze(1)  # (N,)
        words = lengths - ((last == self.vocab.end_id) & (lengths > 0)).long()  # (N,) without <end>
        return self.cider.score_ids(tokens, words, images).float()

    # A NaN/inf loss is handled without reading it back every step (a host synchronisation that stalls a
    # GPU): the optimiser skips its step on the device, and the host looks at the losses every
    # ``nonfinite_check_interval`` steps, before every checkpoint and at the end of each epoch.
    def _watch(self, loss: torch.Tensor) -> None:
        """Flag the coming optimiser step on the device when ``loss`` is not finite; keep it for the host check.

        Every rank takes the same decision (the flags are summed over ranks), so a NaN on one rank never
        leaves the others updating with the NaN gradients it shares with them.
        """
        nonfinite = (~torch.isfinite(loss.detach())).float()
        nonfinite = self.trainer.strategy.reduce(nonfinite, reduce_op="sum") > 0  # () bool, on the device
        self._unchecked.append((self.current_epoch, self.global_step, loss.detach(), nonfinite))
        pending = self._step_nonfinite
        self._step_nonfinite = nonfinite if pending is None else pending | nonfinite  # accumulated batches

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Skip the whole optimiser step of a non-finite loss, on the device.

        A skipped step changes nothing: not the parameters, not Adam's moments, not its step count (the
        learning-rate schedule still advances, as Lightning steps it). Zeroing the loss would not do:
        Adam would still move every parameter by its momentum and decay its moments, and NaN gradients
        can come out of a zeroed NaN graph. The fused Adam of ``configure_optimizers`` takes the flag as
        ``found_inf`` (the mechanism of ``torch.amp.GradScaler``); an optimiser without it (one loaded
        from an older checkpoint, or on a device without fused kernels) drops the gradients instead,
        which needs a host read of the flag every step.
        """
        nonfinite, self._step_nonfinite = self._step_nonfinite, None
        if all(group.get("fused") for group in optimizer.param_groups):
            if nonfinite is None:
                optimizer.__dict__.pop("found_inf", None)
            else:
                optimizer.found_inf = nonfinite.float()  # 1.0: skip (GradScaler's convention)
        elif nonfinite is not None and bool(nonfinite):
            optimizer.zero_grad(set_to_none=True)  # parameters without gradients are not updated

    def on_train_batch_end(self, outputs: Any, batch: dict, batch_idx: int) -> None:
        """Look at the recorded losses every ``nonfinite_check_interval`` training steps."""
        if len(self._unchecked) >= self.settings.nonfinite_check_interval:
            self._check_losses()

    def _check_losses(self) -> None:
        """Read the losses recorded since the last check back to the host (one synchronisation) and report
        the non-finite ones: with model.nonfinite=skip one warning each, with stop an error for the first.

        Their optimiser steps were skipped on the device, so the weights, and every checkpoint (this check
        runs before each one is written), hold no update from a non-finite loss; stopping raises within
        ``nonfinite_check_interval`` steps, and the last checkpoint written is from before the bad step.
        """
        if not self._unchecked:
            return
        unchecked, self._unchecked = self._unchecked, []
        flags = torch.stack([nonfinite for *_, nonfinite in unchecked]).float()
        losses = torch.stack([loss.float() for _, _, loss, _ in unchecked])
        for (epoch, step, _, _), bad, value in zip(unchecked, *torch.stack([flags, losses]).tolist()):
            if bad:
                self._nonfinite(value, f"epoch {epoch}, step {step}")

    def _nonfinite(self, value: float, where: str) -> None:
        """Report a NaN/inf loss ``value`` of the training step ``where``: skipped (a warning) or stop.

        Its optimiser step was skipped: no backward result reached the parameters; the step counter and
        the schedule still advanced. Stopping raises NonFiniteLossError naming the last checkpoint written.
        """
        if self.settings.nonfinite == NonFinite.skip:
            log.warning("non-finite loss (%s) at %s: batch skipped, no parameter update", value, where)
            return
        saved = [
            path
            for c in self.trainer.checkpoint_callbacks
            for path in (c.last_model_path, c.best_model_path)
            if path and os.path.isfile(path)
        ]
        kept = (
            f"the last good checkpoint is {max(saved, key=os.path.getmtime)}"
            if saved
            else "no checkpoint had been saved yet"
        )
        raise NonFiniteLossError(
            f"non-finite loss ({value}) at {where}; training stopped, {kept} "
            "(model.nonfinite=skip skips such batches instead)"
        )

    def on_train_epoch_end(self) -> None:
        """Check the last losses; report unreadable training images once, with the first few names."""
        self._check_losses()
        self._report_skips()

    def _report_skips(self) -> None:
        """Log one line for images that could not be read since the last report (count and first names)."""
        if self.skips.count > self._skips_reported:
            log.warning(self.skips.report())
            self._skips_reported = self.skips.count

    def configure_optimizers(self) -> dict:
        """Adam with its own learning rate for the fine-tuned encoder, plus a schedule."""
        encoder = [p for p in self.model.encoder.parameters() if p.requires_grad]
        encoder_ids = {id(p) for p in encoder}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in encoder_ids]
        settings = self.settings.optimizer
        groups = [{"params": rest, "lr": settings.lr}]
        if encoder:
            groups.append({"params": encoder, "lr": settings.encoder_lr})
        try:  # fused: one kernel per step, and it can skip a step on the device (on_before_optimizer_step)
            optimizer = torch.optim.Adam(groups, weight_decay=settings.weight_decay, fused=True)
        except RuntimeError:  # no fused kernels for these parameters' device
            optimizer = torch.optim.Adam(groups, weight_decay=settings.weight_decay)
        scheduler = self._scheduler(optimizer)
        if scheduler is None:
            return {"optimizer": optimizer}
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def _scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """The configured schedule, stepped every optimiser step; with SCST after cross-entropy epochs in the
        same run, a second phase from ``scst.lr_scale`` times the rates, its schedule started again."""
        cfg, scst = self.settings.scheduler, self.settings.scst
        total = max(1, int(self.trainer.estimated_stepping_batches))
        steps_per_epoch = max(1, total // max(1, self.trainer.max_epochs or 1))
        switch = total
        if self.settings.objective == Objective.scst and scst.after_epochs > 0:
            switch = min(total, scst.after_epochs * steps_per_epoch)
        elif cfg.name == Schedule.none:
            return None

        def factor(step: int) -> float:
            if step < switch:
                return self._schedule_factor(step, switch, cfg.warmup_steps, steps_per_epoch)
            return scst.lr_scale * self._schedule_factor(step - switch, total - switch, 0, steps_per_epoch)

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    def _schedule_factor(self, step: int, steps: int, warmup: int, steps_per_epoch: int) -> float:
        """The configured schedule's learning-rate factor at ``step`` of a phase of ``steps`` steps."""
        cfg = self.settings.scheduler
        if cfg.name == Schedule.none:
            return 1.0
        warmup = min(warmup, max(0, steps - 1))
        if step < warmup:
            return 1e-3 + (1 - 1e-3) * step / warmup  # linear, from 1e-3
        if cfg.name == Schedule.cosine:
            return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, steps - warmup))))
        return cfg.gamma ** ((step - warmup) // (cfg.step_size * steps_per_epoch))  # step

    # --------------------------------------------------------------- evaluation
    def generate(self, batch: dict) -> tuple[Generation, tuple[int, int]]:
        """Decode a batch with the configured method (never teacher-forced)."""
        kwargs = dict(
            **to_dict(self.settings.decoding),
            start_id=self.vocab.start_id,
            end_id=self.vocab.end_id,
            unk_id=self.vocab.unk_id,
        )
        if "features" in batch:
            return self.model.generate_from_features(self._features(batch), **kwargs)
        return self.model.generate(batch["images"], **kwargs)

    def _eval_step(self, batch: dict, split: str) -> None:
        self.skips.add(batch["skipped"])
        if batch["image_ids"].numel() == 0:
            return
        terms = self.criterion(self._forward(batch), batch["captions"])
        self.log(f"{split}/loss", terms["ce"], batch_size=batch["captions"].shape[0], sync_dist=True)
        generation, grid = self.generate(batch)
        boxes = self._boxes.get(split, {})
        tokens = generation.tokens.cpu()
        alphas = generation.alphas.float().cpu()
        for row, image_id in enumerate(batch["image_ids"].tolist()):
            words = self.vocab.decode(tokens[row].tolist())
            self._predictions[image_id] = words
            if image_id in boxes:
                self._correctness.update(image_id, words, alphas[row, : len(words)], grid, boxes[image_id])

    def on_validation_epoch_start(self) -> None:
        self._start_eval("val")

    def on_test_epoch_start(self) -> None:
        self._start_eval("test")

    def _start_eval(self, split: str) -> None:
        self._predictions = {}
        self._correctness = AttentionCorrectness()
        datamodule = self.trainer.datamodule
        self._references = {split: datamodule.references(split)}
        self._boxes = {split: datamodule.boxes(split)}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Decode the validation images and keep their captions for BLEU."""
        self._eval_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Decode the test images and keep their captions for BLEU."""
        self._eval_step(batch, "test")

    def on_validation_epoch_end(self) -> None:
        self._finish_eval("val")

    def on_test_epoch_end(self) -> None:
        self._finish_eval("test")

    def _finish_eval(self, split: str) -> None:
        self._report_skips()
        predictions = _gather(self._predictions)
        self.predictions[split] = predictions
        correctness = _gather_list([self._correctness.state()])  # each image once, padded repeats too
        references = self._references[split]
        hypotheses = {i: words for i, words in predictions.items() if i in references}
        if not hypotheses:
            log.warning("no %s image could be decoded: BLEU not computed", split)
            return
        for name, value in corpus_bleu_scores(references, hypotheses).items():
            self.log(f"{split}/{name}", value, prog_bar=name == "bleu4")
        self.log(f"{split}/cider", corpus_cider_d(references, hypotheses))
        merged = AttentionCorrectness.merge(correctness)
        if merged.words:
            self.log(f"{split}/attention_correctness", merged.compute()["mean_mass"])

    # ------------------------------------------------------------------ export
    def export_bundle(self, path: str) -> None:
        """Write the inference bundle (weights, vocabulary, model config, the data module's image size);
        no Lightning needed to load it."""
        save_bundle(
            path,
            self.model,
            self.vocab,
            self.net_config,
            preprocess={"image_size": self.trainer.datamodule.settings.image_size},
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Checkpoints carry the bundle metadata as plain data (model config, vocabulary, image size), so
        ``captioner.inference.load_model`` reads them with ``weights_only=True``. The losses since
        the last check are checked first: with model.nonfinite=stop a non-finite one stops before the write."""
        self._check_losses()
        checkpoint[CHECKPOINT_KEY] = bundle_metadata(
            self.net_config, self.vocab, {"image_size": self.trainer.datamodule.settings.image_size}
        )


def _gather(predictions: dict[int, list[str]]) -> dict[int, list[str]]:
    """Merge the per-rank predictions; an image the sampler padded in twice is kept once."""
    merged: dict[int, list[str]] = {}
    for part in _gather_list([predictions]):
        merged.update(part)
    return merged


def _gather_list(items: list[Any]) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return items
    gathered: list[list[Any] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, items)
    return [x for part in gathered for x in part]
