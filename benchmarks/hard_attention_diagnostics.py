"""Why hard attention lags soft: gradient signal-to-noise per parameter group, REINFORCE's rewards and
baseline, the entropy bonus and the share of expected-context steps, measured after every epoch of a run.

Trains one run as ``python train.py <overrides>`` does (the same config, data, module and trainer), with
one more callback: after each training epoch, on the same ``--batches`` training batches (the first ones of
the epoch-0 order, kept), the model in training mode (dropout, sampled locations) gives ``--resamples``
gradients per batch of the training loss, per parameter group, without changing the run (the optimiser,
the REINFORCE baseline and torch's random state are left as they were). For each group it writes:

- ``snr``: ||mean gradient||^2 / mean ||gradient - mean||^2 over every batch and resample: the signal-to-noise
  of one step's gradient (minibatch noise and, for hard attention, the sampled locations');
- ``snr_sampling``: the same within each batch, averaged over the batches: the noise of the sampling (and
  dropout) alone, with the minibatch fixed;
- ``norm``: the mean gradient's norm.

And, from the same forward passes: the cross-entropy, how peaked alpha is (its largest weight), how much
larger a sampled cell a_s is than the expected context sum_i alpha_i a_i of the same attention
(E||a_s|| / ||E a_s||: 1 for a one-hot alpha, large for one spread over cells pointing different ways),
and for hard attention the per-step reward (log p of the word) and its baseline, the advantage's spread,
the entropy of alpha and the bonus it earns against the cross-entropy, the share of the caption steps that
read the expected context; all averaged. Each epoch's validation BLEU-4 and attention correctness come from
the run's metrics.

    python benchmarks/hard_attention_diagnostics.py experiment=scenes model=hard     # the harder benchmark, hard
    python benchmarks/hard_attention_diagnostics.py experiment=scenes                # ... soft, for comparison
    python benchmarks/hard_attention_diagnostics.py --table RUN_FOLDER [RUN_FOLDER ...]   # print finished runs

Each run's figures are ``diagnostics.jsonl`` in its run folder (one line per epoch); ``--table`` prints them
beside its validation scores.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import lightning as L
import torch

from captioner.training import objectives

ROOT = Path(__file__).resolve().parents[1]
FILE = "diagnostics.jsonl"
# Parameter groups, by the first name part that matches (model.decoder.attention.* is "attention", ...).
GROUPS = (
    ("attention", ("decoder.attention.",)),
    ("lstm", ("decoder.lstm.",)),
    ("gate+init", ("decoder.f_beta.", "decoder.init_h.", "decoder.init_c.")),
    ("words", ("decoder.embedding.", "decoder.classifier.", "decoder.deep_h.", "decoder.deep_z.")),
    ("encoder", ("encoder.", "feature_norm.", "self_attention.")),
)


def group_of(name: str) -> str | None:
    """The parameter group of ``model``'s parameter ``name`` (None: none of GROUPS)."""
    return next((group for group, prefixes in GROUPS if any(p in name for p in prefixes)), None)


def signal_to_noise(gradients: torch.Tensor) -> float:
    """||mean||^2 / mean ||g - mean||^2 of ``gradients`` (K, P): above 1, one gradient points mostly the mean's way."""
    mean = gradients.mean(dim=0)
    noise = (gradients - mean).square().sum(dim=1).mean()
    return float(mean.square().sum() / noise.clamp_min(1e-30))


class Diagnostics(L.Callback):
    """After each training epoch, the gradient and REINFORCE figures of fixed training batches (see the module
    docstring), appended to ``<run folder>/diagnostics.jsonl``."""

    def __init__(self, out: str, batches: int = 6, resamples: int = 4) -> None:
        self.out, self.batches, self.resamples = Path(out), batches, resamples
        self.kept: list[dict] = []

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: dict, batch_idx: int) -> None:
        if trainer.current_epoch == 0 and len(self.kept) < self.batches and batch["captions"].numel():
            self.kept.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in batch.items()})

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        rng = torch.get_rng_state()
        grads_before = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        module.criterion.eval()  # the REINFORCE baseline does not move
        try:
            row = self._measure(module)
        finally:
            module.criterion.train()
            torch.set_rng_state(rng)
            for name, p in module.named_parameters():
                p.grad = grads_before[name]
        row["epoch"] = trainer.current_epoch
        with (self.out / FILE).open("a") as handle:
            handle.write(json.dumps(row) + "\n")

    def _measure(self, module: L.LightningModule) -> dict:
        names = [(n.removeprefix("model."), p) for n, p in module.named_parameters() if p.requires_grad]
        names = [(n, p) for n, p in names if group_of(n) is not None]
        grads: dict[str, list[list[torch.Tensor]]] = defaultdict(list)  # group -> batch -> resamples (P,)
        sums: dict[str, float] = defaultdict(float)
        count = 0
        module.model.train()
        for batch in self.kept:
            per_batch: dict[str, list[torch.Tensor]] = defaultdict(list)
            for _ in range(self.resamples):
                module.zero_grad(set_to_none=True)
                read: list[torch.Tensor] = []  # the grid the decoder reads (B, L, D)
                hook = module.model.decoder.register_forward_pre_hook(lambda _, args: read.append(args[0].detach()))
                try:
                    output = objectives.teacher_forced(module.model, batch, module.dtype)
                finally:
                    hook.remove()
                terms = module.criterion(output, batch["captions"])
                terms["loss"].backward()
                flat: dict[str, list[torch.Tensor]] = defaultdict(list)
                for name, p in names:
                    grad = torch.zeros_like(p) if p.grad is None else p.grad
                    flat[group_of(name)].append(grad.detach().flatten().float())
                for group, parts in flat.items():
                    per_batch[group].append(torch.cat(parts))
                for key, value in self._figures(module, output, batch, terms, read[0]).items():
                    sums[key] += value
                count += 1
            for group, samples in per_batch.items():
                grads[group].append(torch.stack(samples))
        module.zero_grad(set_to_none=True)
        row: dict = {key: value / count for key, value in sums.items()}
        for group, batches in grads.items():
            every = torch.cat(batches)  # (M * R, P)
            row[f"snr/{group}"] = signal_to_noise(every)
            row[f"snr_sampling/{group}"] = sum(signal_to_noise(b) for b in batches) / len(batches)
            row[f"norm/{group}"] = float(every.mean(dim=0).norm())
        return row

    @staticmethod
    def _figures(
        module: L.LightningModule, output: object, batch: dict, terms: dict, grid: torch.Tensor
    ) -> dict[str, float]:
        """The loss terms and attention figures of one forward pass that read ``grid`` (B, L, D)."""
        mask = (batch["captions"][:, 1:] != 0).float()  # (N, T) real steps (PAD_ID 0)
        steps = mask.sum()
        alphas = output.alphas.detach().float()  # (N, T, L)
        grid = grid.float()[batch["image_index"]]  # (N, L, D)
        context_norm = torch.einsum("ntl,nld->ntd", alphas, grid).norm(dim=-1)  # (N, T): ||sum_i alpha_i a_i||
        cell_norm = torch.einsum("ntl,nl->nt", alphas, grid.norm(dim=-1))  # (N, T): E ||a_s||, s ~ alpha
        figures = {
            "ce": float(terms["ce"].detach()),
            "alpha_max": float((alphas.amax(dim=-1) * mask).sum() / steps),
            # how much larger a sampled cell is than the expected context the same attention gives
            "cell/context norm": float((cell_norm * mask).sum() / (context_norm * mask).sum()),
        }
        if output.sampled is not None:
            sampled = output.sampled.float().unsqueeze(1) * mask  # (N, T)
            figures["expected_share"] = float(1 - sampled.sum() / steps)
            figures["entropy"] = float((output.entropy.detach() * mask).sum() / steps)
            figures["entropy_bonus/ce"] = module.criterion.entropy_weight * figures["entropy"] / figures["ce"]
        if output.location_log_probs is not None:
            nll = torch.nn.functional.cross_entropy(
                output.logits.detach().float().transpose(1, 2), batch["captions"][:, 1:], reduction="none"
            )
            reward, slot = module.criterion.step_rewards(nll, mask)
            used = sampled
            baseline = module.criterion.baseline[slot]
            advantage = (reward - baseline) * used
            n = used.sum().clamp_min(1)
            figures["reward"] = float((reward * used).sum() / n)
            figures["baseline"] = float((baseline * used).sum() / n)
            figures["advantage_std"] = float(((advantage.square().sum() / n) - (advantage.sum() / n) ** 2).sqrt())
            figures["reinforce/ce"] = float(terms["reinforce"].detach().abs() / terms["ce"].detach())
        return figures


def run(name: str, overrides: list[str], batches: int, resamples: int) -> Path:
    """``python train.py <overrides>`` with the Diagnostics callback, in the run folder
    outputs/diagnostics/``name``; that folder."""
    out = ROOT / "outputs" / "diagnostics" / name
    if out.exists():
        sys.exit(f"error: {out} exists (an earlier run of these overrides): move it away to run again")
    callback = "+callbacks.diagnostics"
    command = [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.run.dir={out}"]
    command += [f"{callback}._target_=hard_attention_diagnostics.Diagnostics", f"{callback}.out={out}"]
    command += [f"{callback}.batches={batches}", f"{callback}.resamples={resamples}"]
    path = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    subprocess.run(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, check=True)
    return out


def table(folders: list[Path]) -> str:
    """Each run's epochs, two markdown tables per run: validation BLEU-4 and correctness beside the loss and
    attention figures; the signal-to-noise of each parameter group (all noise / the sampling's alone)."""
    blocks = []
    for folder in folders:
        rows = [json.loads(line) for line in (folder / FILE).read_text().splitlines()]
        scores = _validation(folder)
        figures = [k for k in rows[0] if k != "epoch" and not k.startswith(("snr/", "snr_sampling/", "norm/"))]
        groups = [k.removeprefix("snr/") for k in rows[0] if k.startswith("snr/")]
        header = ["epoch", "val BLEU-4", "correctness", *figures]
        snr_header = ["epoch", *(f"SNR {g} (sampling)" for g in groups)]
        lines = [f"### {folder.name}", "", _row(header), "|" + "---|" * len(header)]
        snr_lines = ["", _row(snr_header), "|" + "---|" * len(snr_header)]
        for row in rows:
            bleu, correct = scores.get(row["epoch"], (math.nan, math.nan))
            lines.append(
                _row([str(row["epoch"]), f"{bleu:.3f}", f"{correct:.3f}", *(_fmt(row.get(k)) for k in figures)])
            )
            snr = [f"{_fmt(row[f'snr/{g}'])} ({_fmt(row[f'snr_sampling/{g}'])})" for g in groups]
            snr_lines.append(_row([str(row["epoch"]), *snr]))
        blocks.append("\n".join(lines + snr_lines))
    return "\n\n".join(blocks)


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def _validation(folder: Path) -> dict[int, tuple[float, float]]:
    """epoch -> (val BLEU-4, val attention correctness) from the run's CSV log."""
    found: dict[int, tuple[float, float]] = {}
    for path in folder.rglob("metrics.csv"):
        with path.open() as handle:
            for line in csv.DictReader(handle):
                if line.get("val/bleu4"):
                    found[int(line["epoch"])] = (
                        float(line["val/bleu4"]),
                        float(line.get("val/attention_correctness") or "nan"),
                    )
    return found


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g}"


def main() -> None:
    """Run one diagnosed training run, or print the tables of finished ones."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default="run", help="the run folder's name, under outputs/diagnostics/")
    parser.add_argument("--table", nargs="+", type=Path, metavar="RUN", help="print these runs' diagnostics")
    parser.add_argument("--batches", type=int, default=6, help="fixed training batches measured each epoch")
    parser.add_argument("--resamples", type=int, default=4, help="gradients per batch (locations, dropout)")
    args, overrides = parser.parse_known_args()
    if args.table:
        print(table(args.table))
        return
    folder = run(args.name, overrides, args.batches, args.resamples)
    print(table([folder]))


if __name__ == "__main__":
    main()
