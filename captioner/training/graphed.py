"""The cross-entropy training step as one CUDA graph (``model.graphs``): the teacher-forced loop's forward, the
loss and the backward of a batch, captured once and replayed for every batch of the same shapes.

Lightning stays the trainer and keeps what follows the backward: the non-finite guard, gradient clipping and the
optimiser's step (fused Adam: a few kernels for all the parameters), on the gradients the replay wrote. The module
returns the replay's loss, and its ``backward`` hook, after Lightning's ``zero_grad``, hands the replay's gradients
to the optimiser instead of back-propagating.

Training batches have one shape whatever the data (``collate``: K captions per image, masked rows for unreadable
images and an epoch's last, smaller batch; captions padded to ``DataConfig.pad_to``). A batch of other shapes
still runs eagerly; the share of steps that replayed is logged and reported at each epoch's end. Under DDP a
replayed step's gradients are all-reduced beside the graph, as one flat buffer the graph fills: before each step
the ranks agree whether it replays (``agree``: one all-reduce on the host, so no rank replays while another runs
eagerly, whose gradients DDP's reducer all-reduces), the module asks DDP not to synchronise a replayed step, and
the reduction is never skipped. Captured too: hard attention's sampling (each replay draws fresh locations and a
fresh expected-context share, whose schedule is a buffer), dropout, the REINFORCE baseline's update. SCST steps run
eagerly: CIDEr-D counts n-grams of sampled captions, shapes a graph cannot hold.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn

from captioner.model.captioner import Captioner
from captioner.model.graphs import CapturedCall, capture_state
from captioner.model.losses import CaptionLoss
from captioner.training.objectives import cross_entropy_terms

log = logging.getLogger(__name__)

# the batch's tensors a cross-entropy step reads; "tokens", the loss's normaliser under DDP (a scalar, in every step
# of a run or in none), leaves the capture's key alone
INPUTS = ("images", "features", "captions", "image_index", "caption_weights", "tokens")
Terms = dict[str, Tensor]


class GraphedSteps:
    """Cross-entropy steps of ``modules`` (the model and the loss) replayed as one CUDA graph for the batch shape
    captured first; ``terms(batch)`` is the step's loss terms (forward and loss, no backward).

    ``capture=False`` runs the same path, warm-up calls and static batch included, eagerly instead of capturing
    it (``CapturedCall``'s: what a CPU can check of the bookkeeping); on a GPU it is always True.
    """

    def __init__(self, modules: nn.Module, terms: Callable[[dict], Terms], capture: bool = True) -> None:
        self.modules = modules
        self.terms = terms
        self.capture = capture
        self.params = [p for p in modules.parameters() if p.requires_grad]
        self.key: Hashable | None = None
        self.call: CapturedCall | Callable[..., tuple[Terms, list, Tensor | None]] | None = None
        self.gradients: list[Tensor | None] = []  # the last replay's, one per parameter (None: not used)
        self.counts = {"replayed": 0, "eager": 0}  # steps since the last ``report``
        self._agreed: bool | None = None  # ``agree``'s answer for the batch whose step comes next
        self._group: dist.ProcessGroup | None = None  # ``_host_group``'s

    def agree(self, batch: dict) -> bool:
        """Whether ``step`` replays ``batch`` (the captured shapes, or the first batch: captured now), on every rank:
        under DDP the ranks take the least of their answers in one all-reduce on the host, so that all replay or
        all run eagerly. Once per batch, before its step, under the step's autocast (the capture's key holds it)."""
        takes = self.key is None or _key(batch) == self.key
        if dist.is_available() and dist.is_initialized():
            flag = torch.tensor([int(takes)])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._host_group())
            takes = bool(flag)
        self._agreed = takes
        return takes

    def step(self, batch: dict) -> Terms | None:
        """The loss terms of ``batch`` after a replay that also computed its gradients (all-reduced across ranks
        when distributed: ``attach_gradients`` hands them over); None when the batch must run eagerly (``agree``,
        asked here unless it was for this batch)."""
        replays = self.agree(batch) if self._agreed is None else self._agreed
        self._agreed = None
        if not replays:
            self.counts["eager"] += 1
            return None
        inputs = [batch[name] for name in INPUTS if name in batch]
        if self.call is None:
            self.key = _key(batch)
            self.call = self._capture(batch, inputs)
        terms, grads, flat = self.call(*inputs)
        if flat is not None:  # DDP: the mean over ranks, as its reducer gives, in one collective
            dist.all_reduce(flat)
            flat.div_(dist.get_world_size())
            parts = iter(flat.split([g.numel() for g in grads if g is not None]))
            grads = [None if g is None else next(parts).view_as(g) for g in grads]
        self.gradients = grads
        self.counts["replayed"] += 1
        return terms

    def attach_gradients(self) -> None:
        """Hand the last replay's gradients to the optimiser (``.grad``): in the module's ``backward`` hook, after
        Lightning's ``zero_grad``, which comes between the training step and the backward."""
        for param, grad in zip(self.params, self.gradients):
            param.grad = grad

    def report(self) -> tuple[float, str] | None:
        """The share of the training steps since the last report that replayed the graph, and one line on them
        (None when there were none: an SCST epoch); the counts restart."""
        counts, self.counts = self.counts, {"replayed": 0, "eager": 0}
        total = counts["replayed"] + counts["eager"]
        if not total:
            return None
        share = counts["replayed"] / total
        line = f"{counts['replayed']} of {total} training steps ({share:.0%}) replayed the CUDA graph"
        if counts["eager"]:
            line += (
                f"; {counts['eager']} ran eagerly: their batch had other shapes than the captured one, on this rank "
                "or another"
            )
        return share, line

    def _host_group(self) -> dist.ProcessGroup | None:
        """The process group ``agree`` all-reduces its CPU flag in: the default one when it is gloo's, else a gloo
        group of all ranks made on first use (a flag on the host never waits for the device)."""
        if self._group is None and dist.get_backend() != dist.Backend.GLOO:
            self._group = dist.new_group(backend=dist.Backend.GLOO)
        return self._group

    def _capture(self, batch: dict, inputs: list[Tensor]) -> CapturedCall:
        names = [name for name in INPUTS if name in batch]
        rest = {k: v for k, v in batch.items() if k == "captions_per_image"}
        distributed = dist.is_available() and dist.is_initialized()

        def step(*tensors: Tensor) -> tuple[Terms, list, Tensor | None]:
            for param in self.params:
                param.grad = None  # the backward writes fresh gradients, in the graph's memory
            terms = self.terms({**dict(zip(names, tensors)), **rest})
            with torch.autocast(terms["loss"].device.type, enabled=False):  # as Lightning's backward: no autocast
                terms["loss"].backward()
            grads = [param.grad for param in self.params]
            flat = torch.cat([g.reshape(-1) for g in grads if g is not None]) if distributed else None
            return {k: v.detach() for k, v in terms.items()}, grads, flat

        return CapturedCall(step, inputs, keep=self.modules, capture=self.capture)  # the warm-up undone


def training_graphs(
    trainer: L.Trainer, model: Captioner, criterion: CaptionLoss, dtype: torch.dtype, capture: bool = True
) -> GraphedSteps | None:
    """``model``'s cross-entropy steps (loss ``criterion``, cached features cast to ``dtype``) as CUDA graphs for
    ``trainer``'s run, or None where its precision or gradient accumulation needs them eager (logged either way);
    ``capture``: ``GraphedSteps``'."""
    why = None
    if str(trainer.precision).startswith("16"):
        why = f"precision={trainer.precision} scales each step's loss on the host (GradScaler)"
    elif trainer.accumulate_grad_batches > 1:
        why = f"accumulate_grad_batches={trainer.accumulate_grad_batches} adds gradients across steps"
    if why is not None:
        log.info("model.graphs: training steps run eagerly, %s; decoding is graphed", why)
        return None
    log.info("model.graphs: each cross-entropy training step replays one CUDA graph, and each decoding call")
    terms = functools.partial(cross_entropy_terms, model, criterion, dtype=dtype)
    return GraphedSteps(nn.ModuleList([model, criterion]), lambda batch: terms(batch=batch), capture)


def _key(batch: dict) -> Hashable:
    """What a captured step depends on in ``batch``: its tensors' shapes and dtypes, the captions' layout, the
    autocast state."""
    shaped = (name for name in INPUTS if name in batch and name != "tokens")
    tensors = tuple((name, tuple(batch[name].shape), batch[name].dtype) for name in shaped)
    return tensors, batch.get("captions_per_image"), capture_state(batch["captions"].device)
