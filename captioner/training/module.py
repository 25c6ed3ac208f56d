"""The LightningModule: wires the captioner to its objectives, schedule, optimiser and evaluation.

Training optimises cross-entropy (``objective=cross_entropy``) or fine-tunes a trained model with
self-critical sequence training (``objective=scst``: CIDEr-D of sampled captions as the reward):
``training.objectives``. The learning-rate schedule and the switch to SCST are ``training.schedule``'s,
Adam and gradient clipping under every precision ``training.optimization``'s, the non-finite-loss guard
``training.callbacks``'. Validation never teacher-forces BLEU: it decodes (greedy or beam) and
``training.evaluation`` gathers the captions of every rank and scores them.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L
import torch
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import Dataset

from captioner.bundle import CHECKPOINT_KEY, bundle_metadata, save_bundle
from captioner.config import Compile, ModelConfig, Objective, to_dict
from captioner.data.dataset import SkipCounter
from captioner.data.features import Batches, FeatureCache, Share
from captioner.data.vocab import PAD_ID, UNK_ID, Vocabulary
from captioner.errors import ConfigError, DataError
from captioner.evaluation.cider import CiderD
from captioner.model.captioner import Captioner, build_captioner
from captioner.model.decoding import Generation
from captioner.model.losses import CaptionLoss, SelfCriticalLoss
from captioner.model.pretrained import fetch
from captioner.training import objectives, quick_checks
from captioner.training.callbacks import NonFiniteLossGuard
from captioner.training.datamodule import CaptionDataModule
from captioner.training.evaluation import EvaluationEpoch
from captioner.training.graphed import (
    GraphedSteps,
    SelfCriticalSteps,
    StepGraphs,
    graphed_training,
    self_critical_graphs,
    training_graphs,
)
from captioner.training.loggers import LEARNING_RATES
from captioner.training.metrics import EVALUATION, GRAPH_REPLAYS, LOSS, PROGRESS, TEST, TRAIN, VAL, metric
from captioner.training.optimization import build_optimizer, clip_gradients
from captioner.training.schedule import CrossEntropyPhase, LearningRatePlan, build_scheduler, self_critical_epoch

log = logging.getLogger(__name__)

PHASE_KEY = "cross_entropy_steps"  # a checkpoint's CrossEntropyPhase.steps
RATES_KEY = "learning_rate_phases"  # a checkpoint's LearningRatePlan.state()


class CaptionerModule(L.LightningModule):
    """Show, Attend and Tell training: masked cross-entropy + doubly stochastic (+ REINFORCE for hard), or
    self-critical sequence training of a trained model (``objective="scst"``, settings in ``scst``)."""

    def __init__(self, vocab: Vocabulary, settings: ModelConfig, pretrained: bool = True) -> None:
        """The model of ``settings`` (the ``model`` config, typed) for the words of ``vocab``; the encoder's ImageNet
        weights are downloaded first where ``encoder.download`` is on and their file is missing (the preflight did in
        the process that started the run; another process of the run waits for or makes its machine's download).
        ``pretrained`` False: a checkpoint's weights replace all of them before any feature is computed (a run
        resumed, or started from another's weights), so their file is neither read nor needed."""
        super().__init__()
        self.settings = settings
        self.save_hyperparameters(to_dict(self.settings))  # every setting, as plain data (weights_only loads it)
        self.vocab = vocab
        self.net = self.settings.net()  # what the bundle stores
        if settings.encoder.download and pretrained:
            fetch(self.net.encoder.name, self.net.encoder.weights)
        self.model: Captioner = build_captioner(self.net if pretrained else self.net.without_pretrained(), len(vocab))
        self.model.decoder.fuse_attention(settings.fused_attention)
        self.criterion = CaptionLoss(self.settings.loss, PAD_ID, UNK_ID)
        self.self_critical = SelfCriticalLoss(self.settings.scst.baseline)
        self.cider: CiderD | None = None  # the SCST reward: CIDEr-D against the training references
        self.skips = SkipCounter()
        self._skips_reported = 0
        self._evaluation: EvaluationEpoch | None = None
        self.predictions: dict[str, dict[int, list[str]]] = {}  # split -> image id -> words, all ranks
        self._frozen_fingerprint: str | None = None  # of the encoder's frozen stages, which a run never changes
        self.phase: CrossEntropyPhase | None = None  # set when training starts, or by the resumed checkpoint
        self.learning_rates: LearningRatePlan | None = None  # laid over the run by configure_optimizers
        self._resumed_rates: tuple[list[dict], int] | None = None  # the resumed checkpoint's plan, and its step
        self.graphed_steps: GraphedSteps | None = None  # model.graphs' cross-entropy steps (a fit on CUDA)
        self.graphed_scst: SelfCriticalSteps | None = None  # and its SCST steps (objective=scst)
        self._replayed: StepGraphs | None = None  # what replayed this batch's step, its backward done (None: eager)

    # ----------------------------------------------------------------- training
    def setup(self, stage: str) -> None:
        """Turn on CUDA graphs (``model.graphs``; None: on CUDA) and compile the decoder's step (``model.compile``);
        with either, training captions are padded to ``DataConfig.caption_tokens`` (``data.pad_to``) unless set. A
        fit whose length the schedules cannot be laid out over is refused (``ModelConfig.unscheduled``)."""
        if stage == "fit" and (problem := self.settings.unscheduled(self.trainer.max_epochs, self.trainer.max_steps)):
            raise ConfigError(problem)
        mode = self.settings.compile or Compile.off
        # the model is not on its device yet: ask the strategy
        graphs = self.settings.uses_graphs(self.trainer.strategy.root_device.type == "cuda")
        self.model.decoder.use_decoding_graphs(graphs)
        if graphs and stage == "fit":
            self.use_training_graphs()
        if mode != Compile.off:
            self.model.decoder.compile_step(mode)
            log.info("model.compile=%s: the decoder's step is compiled", mode)
        datamodule = self.trainer.datamodule
        if (graphs or mode != Compile.off) and datamodule is not None and datamodule.settings.pad_to is None:
            # one caption width: CUDA graphs replay the steps of a training batch as they were recorded
            datamodule.settings.pad_to = datamodule.settings.caption_tokens
            log.info("captions padded to data.pad_to=%d tokens", datamodule.settings.pad_to)

    def use_training_graphs(self, capture: bool = True) -> None:
        """Replay this fit's training steps as CUDA graphs (``training.graphed``): each cross-entropy step as one and,
        with ``objective=scst``, each SCST step as two, unless the trainer's precision or gradient accumulation
        keeps them eager; ``capture``: ``StepGraphs``' (False: what a CPU can check of them)."""
        if not graphed_training(self.trainer):
            return
        self.graphed_steps = training_graphs(self.model, self.criterion, self.dtype, capture)
        if self.settings.objective == Objective.scst:
            self.graphed_scst = self_critical_graphs(  # the reward's tables are built when the fit starts
                self.model,
                self.self_critical,
                lambda: self.cider,
                self.dtype,
                self.settings,
                capture,
                distributed=self._distributed,
            )

    def configure_callbacks(self) -> list[L.Callback]:
        """The non-finite-loss guard, in every run, with this model's ``nonfinite`` settings."""
        return [NonFiniteLossGuard(self.settings.nonfinite, self.settings.nonfinite_check_interval)]

    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        """With graphed steps: the ranks agree whether this batch replays (``StepGraphs.agree``, under the
        step's autocast, which the capture's key holds); under DDP a replayed step's gradients are all-reduced
        beside the graph (``StepGraphs.step``), so DDP's reducer synchronises only the backward of an eager step."""
        if self.graphed_steps is None and self.graphed_scst is None:
            return
        replays = False
        if (steps := self._epoch_graphs) is not None:
            with self.trainer.precision_plugin.train_step_context():
                replays = steps.agree(batch)
        model = self.trainer.strategy.model
        if isinstance(model, DistributedDataParallel):
            model.require_backward_grad_sync = not replays

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor | None:
        """One step over a batch of images with their captions (K per image: ``collate``)."""
        self.skips.add(batch["skipped"])
        self._replayed = None
        if batch["captions"].numel() == 0:
            return None
        self.model.decoder.anneal(self.phase.progress(self.global_step))
        if not self.scst_epoch and self._distributed:  # each rank's loss over the global batch's tokens
            batch = {**batch, "tokens": objectives.token_share(self.criterion, batch)}
        steps = self._epoch_graphs
        terms = None if steps is None else steps.step(batch)
        if terms is not None:
            self._replayed = steps
        elif self.scst_epoch:
            terms = self.self_critical_terms(batch)
        else:
            terms = objectives.cross_entropy_terms(self.model, self.criterion, batch, self.dtype)
        loss = terms["loss"]
        size = batch["captions"].shape[0]
        self.log_dict({metric(TRAIN, k): v.detach() for k, v in terms.items() if k != "loss"}, batch_size=size)
        self.log(metric(TRAIN, LOSS), loss.detach(), prog_bar=True, batch_size=size)
        return loss

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """Back-propagate ``loss``, unless the step was a replay: its graph did, and its gradients are handed over."""
        if self._replayed is not None:
            self._replayed.attach_gradients()
        else:
            super().backward(loss, *args, **kwargs)

    @property
    def _distributed(self) -> bool:
        """Whether the module trains in one of several processes (DDP): its losses are normalised over all of them."""
        return self._trainer is not None and self.trainer.world_size > 1

    @property
    def scst_epoch(self) -> bool:
        """Whether this epoch trains with SCST (objective=scst, after ``scst.after_epochs`` cross-entropy epochs)."""
        return self_critical_epoch(self.settings.objective, self.settings.scst, self.current_epoch)

    @property
    def _epoch_graphs(self) -> StepGraphs | None:
        """The graphed steps of this epoch's objective (None: its steps run eagerly)."""
        return self.graphed_scst if self.scst_epoch else self.graphed_steps

    def on_train_start(self) -> None:
        """Measure the cross-entropy phase the decoder anneals over, unless the resumed checkpoint holds it; say when
        the learning rate's warm-up takes the whole run, and when the training loss is logged more often than
        ``trainer.log_every_n_steps`` says (``quick_checks.fit_log_interval``)."""
        if self.phase is None:
            self.phase = CrossEntropyPhase.of_run(self.settings, self.trainer)
        if (note := self.phase.warmup_note(self.settings)) is not None:
            log.info(note)
        interval = quick_checks.fit_log_interval(self.trainer)  # on every rank: they log at the same steps
        if self.trainer.is_global_zero:
            if interval is not None:
                log.info(interval)
            if (warmup := self.learning_rates.warmup_note(self.settings.optimizer.lr)) is not None:
                log.warning(warmup)

    @property
    def in_warmup(self) -> bool:
        """Whether the model is inside hard attention's warm-up, where no validation selects the best checkpoint
        nor counts for early stopping (``training.callbacks``) unless ``select_in_warmup``."""
        return self.phase is not None and self.phase.selection_waits(self.settings, self.global_step)

    def on_train_epoch_start(self) -> None:
        """Move a streamed training split on to this epoch's shard order (before its loader is iterated); say when
        self-critical training takes over from cross-entropy in the run."""
        datamodule, fetcher = self.trainer.datamodule, self.trainer.fit_loop._data_fetcher
        moved = isinstance(datamodule, CaptionDataModule) and datamodule.set_epoch(self.current_epoch)
        if moved and fetcher is not None:
            # The loader was iterated before this epoch was known (a resumed run's first epoch: Lightning sets the
            # train loader up in configure_optimizers, before the loops' state is restored, and does not iterate it
            # again): its workers may already read another epoch's order. Iterated again, they start this one's.
            iter(fetcher)
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
        settings = self.settings
        return objectives.self_critical_terms(
            self.model,
            self.self_critical,
            self.cider,
            batch,
            self.dtype,
            settings.scst,
            settings.decoding,
            self.vocab,
            settings.static_shapes,
            distributed=self._distributed,
        )

    def on_train_epoch_end(self) -> None:
        """Report unreadable training images once, with the first few names, where the epoch's images were
        decoded when the device decodes JPEGs (``data.decode``), and the share of the epoch's steps that replayed
        the CUDA graph (logged as ``train/graph_replays`` too)."""
        self._report_skips()
        self._report_decoding()
        if (steps := self._epoch_graphs) is not None and (report := steps.report()) is not None:
            share, line = report
            self.log(metric(TRAIN, GRAPH_REPLAYS), share)
            log.info(line)

    def _report_decoding(self) -> None:
        """Log one line for where the images of the batches since the last report were decoded, when the device
        decoded JPEGs (``data.decode``)."""
        datamodule = self.trainer.datamodule
        if isinstance(datamodule, CaptionDataModule) and (line := datamodule.decoding_report()):
            log.info(line)

    def _report_skips(self) -> None:
        """Log one line for images that could not be read since the last report (count and first names)."""
        if self.skips.count > self._skips_reported:
            log.warning(self.skips.report())
            self._skips_reported = self.skips.count

    def configure_optimizers(self) -> dict:
        """Adam with its own learning rate for the fine-tuned encoder, plus a schedule, named so that the learning
        rates are logged as ``train/lr/decoder`` and ``train/lr/encoder`` (``LearningRateMonitor``)."""
        encoder = [p for p in self.model.encoder.parameters() if p.requires_grad]
        encoder_ids = {id(p) for p in encoder}
        rest = [p for p in self.parameters() if p.requires_grad and id(p) not in encoder_ids]
        optimizer = build_optimizer(rest, encoder, self.settings.optimizer)
        self.learning_rates = LearningRatePlan.of_run(self.settings, self.trainer)
        if self._resumed_rates is not None:  # on from the rate the resumed run had reached
            self.learning_rates = self.learning_rates.resumed(*self._resumed_rates)
        scheduler = {"scheduler": build_scheduler(optimizer, self.learning_rates), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": {**scheduler, "name": LEARNING_RATES}}

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Clip the true (unscaled) gradients under every precision (``training.optimization.clip_gradients``)."""
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)

    # --------------------------------------------------------------- evaluation
    def generate(self, batch: dict) -> tuple[Generation, tuple[int, int]]:
        """Decode a batch with the configured method (never teacher-forced)."""
        options = dict(decoding=self.settings.decoding, unk_id=UNK_ID, static_shapes=self.settings.static_shapes)
        if "features" in batch:
            return self.model.generate_from_features(objectives.cached_features(batch, self.dtype), **options)
        return self.model.generate(batch["images"], **options)

    def _eval_step(self, batch: dict, split: str) -> None:
        self.skips.add(batch["skipped"])
        if batch["image_ids"].numel() == 0:
            return
        terms = objectives.cross_entropy_terms(self.model, self.criterion, batch, self.dtype)
        self.log(metric(split, LOSS), terms["ce"], batch_size=batch["captions"].shape[0], sync_dist=True)
        generation, grid = self.generate(batch)
        self._evaluation.add(batch["image_ids"].tolist(), generation, grid, self.vocab)

    def on_validation_epoch_start(self) -> None:
        self._start_eval(VAL)

    def on_test_epoch_start(self) -> None:
        self._start_eval(TEST)

    def _start_eval(self, split: str) -> None:
        """A new evaluation of ``split``; the scores of the last one are taken out of the trainer's callback metrics,
        where Lightning keeps a metric until it is logged again: an epoch whose captions named no boxed object has
        no attention correctness (not the last epoch's) for the checkpoint, early stopping and the curves."""
        for name in EVALUATION:
            self.trainer.callback_metrics.pop(metric(split, name), None)
        datamodule = self.trainer.datamodule
        self._evaluation = EvaluationEpoch(split, datamodule.references(split), datamodule.boxes(split))

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        """Decode the validation images and keep their captions for BLEU."""
        self._eval_step(batch, VAL)

    def test_step(self, batch: dict, batch_idx: int) -> None:
        """Decode the test images and keep their captions for BLEU."""
        self._eval_step(batch, TEST)

    def on_validation_epoch_end(self) -> None:
        self._finish_eval(VAL)

    def on_test_epoch_end(self) -> None:
        self._finish_eval(TEST)

    def _finish_eval(self, split: str) -> None:
        self._report_skips()
        self.predictions[split], scores = self._evaluation.finish()
        if not scores:  # early stopping and checkpointing would fail on a missing metric, with a traceback
            unread = f" ({self.skips.report(1)})" if self.skips.count else ""
            raise DataError(
                f"no {split} image could be decoded{unread}, so there is nothing to score: the run stops "
                "(docs/datasets.md#images)"
            )
        self._report_decoding()
        for name, value in scores.items():
            self.log(metric(split, name), value, prog_bar=name == PROGRESS)

    # ------------------------------------------------------------- feature cache
    def cached_stages(self) -> dict[str, Any]:
        """What a feature cache of this model holds the output of: its encoder's settings and the fingerprint
        of its frozen stages (``training.datamodule.FeatureEncoder``)."""
        encoder = self.model.encoder
        if encoder.frozen_stages == 0:
            raise DataError(
                "data.feature_cache holds the output of the encoder's frozen stages and "
                f"model.encoder.trainable_stages={encoder.trainable_stages} trains all of them: "
                "freeze some (a smaller trainable_stages) or set data.feature_cache=null"
            )
        if self._frozen_fingerprint is None:  # hashing the frozen weights takes seconds for a large CNN: once
            self._frozen_fingerprint = encoder.frozen_fingerprint()
        return {**to_dict(self.net.encoder), "frozen_weights": self._frozen_fingerprint}

    def fill_cache(
        self, cache: FeatureCache, images: Dataset, batches: Batches, batch_size: int, dtype: str, share: Share
    ) -> None:
        """Write the output of the encoder's frozen stages (in eval mode) for the images of ``share`` into ``cache``
        (``FeatureCache.fill``)."""
        encoder = self.model.encoder
        was_training = encoder.training
        encoder.eval()
        cache.fill(self.model.encode, images, batches, batch_size, self.device, dtype, share)
        encoder.train(was_training)

    # ------------------------------------------------------------------ export
    def export_bundle(self, path: str) -> None:
        """Write the inference bundle (weights, vocabulary, model config, the data module's image size, and
        the run's decoding with captioning's method, as its final scores were decoded); no Lightning needed to
        load it."""
        save_bundle(
            path,
            self.model,
            self.vocab,
            self.net,
            preprocess={"image_size": self.trainer.datamodule.settings.image_size},
            decoding=self.settings.decoding.for_captioning(),
        )

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Checkpoints carry the bundle metadata as plain data (model config, vocabulary, image size, decoding), so
        ``captioner.bundle.load_trained`` reads them with ``weights_only=True``."""
        checkpoint[CHECKPOINT_KEY] = bundle_metadata(
            self.net,
            self.vocab,
            {"image_size": self.trainer.datamodule.settings.image_size},
            self.settings.decoding.for_captioning(),
        )
        if self.phase is not None:
            checkpoint[PHASE_KEY] = self.phase.steps
        if self.learning_rates is not None:
            checkpoint[RATES_KEY] = self.learning_rates.state()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """A resumed run anneals over the cross-entropy phase its checkpoint was measuring, and its learning rates
        go on from the plan the checkpoint was following (one written before either was stored: laid out again
        from this run's settings)."""
        if PHASE_KEY in checkpoint:
            self.phase = CrossEntropyPhase(checkpoint[PHASE_KEY])
        if RATES_KEY in checkpoint:
            self._resumed_rates = (checkpoint[RATES_KEY], checkpoint["global_step"])
