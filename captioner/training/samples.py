"""Pictures of a run while it trains: after every validation a few validation images captioned and attended,
in the run folder and in the run's loggers; at the end the run's curves.

``TrainingPictures`` (``callbacks.samples`` in ``conf/callbacks/default.yaml``; ``callbacks.samples=null`` turns
it off) picks ``count`` validation images once, spread evenly over the split, and keeps their ids in its
checkpoint state, so every epoch and every resume shows the same ones (listed in ``samples/picked.json``).
After each validation of a fit it decodes them as validation decodes (``CaptionerModule.generate``) and
writes ``samples/epoch_<epoch>.png`` (``captioner.viz.training``); TensorBoard gets each sample as an image
drawn for its images tab (``viz.training.TENSORBOARD``: narrow enough for its text to be read there) and its
caption and references as text, under ``val/samples/image_<id>`` (beside the validation's scalars, after them),
W&B the overlays with their captions, MLflow the sheet as an artifact, under the step of the validation's
scalars. When the fit ends (or stops), ``curves.png`` plots
the run's whole history, which the checkpoints carry across a resume.

It never changes training: only rank 0 decodes and draws, in no-grad with every module's mode and every
random generator (torch's, NumPy's, Python's) put back as they were, and it logs no metric. A failure to
decode or draw (a missing font, a full disk) is one warning, and training goes on.
"""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from PIL import Image

from captioner.config import SamplesConfig
from captioner.data.dataset import Skipped, collate
from captioner.data.images import load_rgb
from captioner.data.readers import Record
from captioner.fileio import atomic_write
from captioner.inference import attended_cells
from captioner.run_files import CURVES_FILE, SAMPLES_DIR
from captioner.training.metrics import CIDER, CORRECTNESS, PROGRESS, VAL, metric
from captioner.viz.training import TENSORBOARD, TRAIN_LOSS, Sample, draw_curves, draw_sample_sheet, sample_picture

log = logging.getLogger(__name__)

PICKED_FILE = "picked.json"  # in SAMPLES_DIR: the images drawn, with their files and references
# what the pictures cost, said when the fit ends (benchmarks/samples_cost.py reads it)
COST_LINE = "pictures: %.2f s for %d sample sheets and the curves, %.2f %% of the fit's %.1f s"
RECORDED = (metric(VAL, PROGRESS), metric(VAL, CIDER), metric(VAL, CORRECTNESS))  # a validation's history keys


class TrainingPictures(L.Callback):
    """Sample sheets after every validation, the run's curves at its end (module docstring)."""

    def __init__(self, dirpath: str, count: int = SamplesConfig.count) -> None:
        """Write into the run folder ``dirpath``; draw ``count`` validation images (``SamplesConfig``)."""
        self.folder = Path(dirpath)
        self.count = SamplesConfig(count=count).count
        self.picked: list[int] = []  # image ids, chosen at the first validation
        self.history: list[dict[str, Any]] = []  # one row per validation (and per epoch without one)
        self.seconds = 0.0  # spent decoding and drawing in this process: what the pictures cost
        self.validations = 0  # sample sheets drawn (or tried) in this process
        self._fit_start = time.perf_counter()
        self._stated = False  # whether samples/picked.json names the picked images in this run's folder
        self._loss_sum: torch.Tensor | None = None  # training loss summed on the device since the last row
        self._batches = 0

    # ------------------------------------------------------------------ history
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Add the batch's loss to the sum, on the device (no host read)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor):
            loss = loss.detach().float() * trainer.accumulate_grad_batches  # Lightning's outputs are divided by it
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._batches += 1

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A row of history (before the checkpoints of this validation are written), then the sample sheet."""
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        values = {key: float(trainer.callback_metrics[key]) for key in RECORDED if key in trainer.callback_metrics}
        checkpoint = trainer.checkpoint_callback
        monitor = getattr(checkpoint, "monitor", None)
        if monitor in trainer.callback_metrics:
            values["monitor"] = float(trainer.callback_metrics[monitor])
        self._add_row(trainer, pl_module, values)
        if trainer.is_global_zero:
            self.validations += 1
            self._guarded("samples", self._draw_samples, trainer, pl_module)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """A row for an epoch that had no validation (its training loss only)."""
        if not self.history or self.history[-1]["epoch"] != trainer.current_epoch:
            self._add_row(trainer, pl_module, {})

    def _add_row(self, trainer: L.Trainer, pl_module: L.LightningModule, values: dict[str, float]) -> None:
        """Append the row of this epoch: its mean training loss since the last row (one host read), whether it
        trained with SCST, and ``values``."""
        loss = None
        if self._loss_sum is not None:
            loss = float(self._loss_sum) / self._batches
        self._loss_sum, self._batches = None, 0
        scst = bool(getattr(pl_module, "scst_epoch", False))
        row = {"epoch": trainer.current_epoch, "step": trainer.global_step, TRAIN_LOSS: loss, "scst": scst}
        self.history.append({**row, **values})

    def picked_epoch(self, trainer: L.Trainer) -> int | None:
        """The epoch of the checkpoint the run picked: the first validation whose monitored value is the best
        checkpoint's score (None: no best checkpoint)."""
        score = getattr(trainer.checkpoint_callback, "best_model_score", None)
        if score is None:
            return None
        best = float(score)
        return next((row["epoch"] for row in self.history if np.isclose(row.get("monitor", np.nan), best)), None)

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Start the clock of the fit, against which the pictures' cost is told."""
        self._fit_start = time.perf_counter()

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Draw the run's curves; say what the pictures cost."""
        if not trainer.is_global_zero:
            return
        self._guarded("curves", self._draw_curves, trainer)
        wall = time.perf_counter() - self._fit_start
        log.info(COST_LINE, self.seconds, self.validations, 100 * self.seconds / max(wall, 1e-9), wall)

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """A run that stops (an error, Ctrl-C) still gets the curves of what it trained."""
        self.on_fit_end(trainer, pl_module)

    def _draw_curves(self, trainer: L.Trainer) -> None:
        if not self.history:
            return
        path = draw_curves(self.history, self.picked_epoch(trainer), self.folder / CURVES_FILE)
        for logger in trainer.loggers:
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_artifact(logger.run_id, str(path))

    def state_dict(self) -> dict[str, Any]:
        """The picked images and the history: a resumed run shows the same images and draws every epoch."""
        return {"picked": list(self.picked), "history": [dict(row) for row in self.history]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the picked images and the history of the checkpoint."""
        self.picked = list(state_dict.get("picked", []))
        self.history = [dict(row) for row in state_dict.get("history", [])]

    # ------------------------------------------------------------------ samples
    def _draw_samples(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Decode the picked images as validation does, draw their sheet and hand it to the loggers."""
        datamodule = trainer.datamodule
        records = self._records(datamodule.splits[VAL])
        if not records:
            return
        samples = self._decode(trainer, pl_module, records)
        if not samples:
            return
        epoch = trainer.current_epoch
        name = f"epoch_{epoch:03d}.png"
        if (self.folder / SAMPLES_DIR / name).exists():  # a second validation in the epoch
            name = f"epoch_{epoch:03d}_step_{trainer.global_step:07d}.png"
        sheet = self.folder / SAMPLES_DIR / name
        overlays = draw_sample_sheet(samples, epoch, sheet)
        publish(trainer, samples, overlays, sheet)

    def _records(self, split: list[Record]) -> list[Record]:
        """The records of the picked images, picking them (evenly over the split) the first time; the choice
        is written to ``samples/picked.json``."""
        by_id = {record.image_id: record for record in split}
        if not self.picked or any(image_id not in by_id for image_id in self.picked):
            if self.picked:
                log.warning("the validation split lacks images picked for samples earlier: picking again")
            count = min(self.count, len(split))
            self.picked = [split[i * len(split) // count].image_id for i in range(count)] if count else []
            self._stated = False
        if not self._stated:  # in this run's folder (a resumed run writes a new one)
            picked = [
                {"image_id": by_id[i].image_id, "image": by_id[i].image_path, "references": list(by_id[i].captions)}
                for i in self.picked
            ]
            with atomic_write(self.folder / SAMPLES_DIR / PICKED_FILE, "w") as handle:
                json.dump(picked, handle, indent=2)
            self._stated = True
        return [by_id[image_id] for image_id in self.picked]

    def _decode(self, trainer: L.Trainer, pl_module: L.LightningModule, records: list[Record]) -> list[Sample]:
        """The picked images decoded as validation decodes (its preprocessing, precision and decoding), with
        their pictures and references."""
        dataset = trainer.datamodule.image_dataset(VAL, records=records)
        items = [dataset[i] for i in range(len(records))]
        kept = [item for item in items if not isinstance(item, Skipped)]
        if not kept:
            return []
        batch = collate(kept)
        precision = trainer.precision_plugin
        with untouched(pl_module), precision.forward_context():
            batch = {key: value.to(pl_module.device) for key, value in batch.items() if isinstance(value, torch.Tensor)}
            generation, grid = pl_module.generate(precision.convert_input(batch))
        tokens, alphas = generation.tokens.cpu(), generation.alphas.float().cpu()
        samples = []
        for row, item in enumerate(kept):
            record = records[item["index"]]
            words = pl_module.vocab.decode(tokens[row].tolist())
            maps = alphas[row, : len(words)]  # (T, L)
            picture = load_rgb(record.image_path)
            locations = attended_cells(pl_module.model, maps)
            samples.append(Sample(record.image_id, picture, words, maps, grid, record.captions, locations))
        return samples

    def _guarded(self, what: str, draw: Any, *args: Any) -> None:
        """Run ``draw(*args)``, timed; a failure is one warning and training goes on."""
        start = time.perf_counter()
        try:
            draw(*args)
        except Exception as exc:  # noqa: BLE001 - pictures never stop a run
            log.warning("could not draw the %s (%s: %s); training goes on", what, type(exc).__name__, exc)
        finally:
            self.seconds += time.perf_counter() - start


@contextmanager
def untouched(module: torch.nn.Module) -> Iterator[None]:
    """Run the body in no-grad and eval mode, then put back every submodule's mode and the random generators
    (torch's on the CPU and the module's device, NumPy's, Python's) as they were."""
    modes = [(m, m.training) for m in module.modules()]
    devices = [module.device] if getattr(module, "device", torch.device("cpu")).type == "cuda" else []
    python, numpy = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            module.eval()
            yield
    finally:
        for m, training in modes:
            m.training = training
        random.setstate(python)
        np.random.set_state(numpy)


def logged_step(trainer: L.Trainer) -> int:
    """The step Lightning logs a validation's scalars under (its fit loop's count of batches that stepped,
    not ``global_step``), so that the pictures line up with them."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def publish(trainer: L.Trainer, samples: list[Sample], overlays: list[Image.Image], sheet: Path) -> None:
    """Give the loggers of ``trainer`` the ``samples``: TensorBoard an image (each sample drawn for its images tab,
    ``viz.training.TENSORBOARD``) and a text (caption and references) per sample, W&B their pictures on the
    sheet (``overlays``) with their captions, MLflow the ``sheet``."""
    step = logged_step(trainer)
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            for sample in samples:
                tag = sample_tag(sample)
                picture = sample_picture(sample, trainer.current_epoch, TENSORBOARD)
                logger.experiment.add_image(tag, np.asarray(picture), step, dataformats="HWC")
                logger.experiment.add_text(tag, caption_markdown(sample), step)
            logger.experiment.flush()
        elif isinstance(logger, WandbLogger):
            captions = [f"{s.image_id}: {s.caption} (reference: {s.references[0]})" for s in samples]
            logger.log_image(key="samples", images=overlays, step=step, caption=captions)
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_artifact(logger.run_id, str(sheet), SAMPLES_DIR)


def sample_tag(sample: Sample) -> str:
    """The TensorBoard tag of ``sample``'s picture and text: ``val/samples/image_<id>``."""
    return metric(VAL, f"samples/image_{sample.image_id}")


def caption_markdown(sample: Sample) -> str:
    """A sample's caption and references, as TensorBoard's text panel shows them (markdown)."""
    references = "\n".join(f"- {reference}" for reference in sample.references)
    return f"**caption:** {sample.caption or '(empty)'}\n\n**references:**\n\n{references}"
