"""Training steps as CUDA graphs (``model.graphs``): a cross-entropy step's forward, loss and backward as one graph;
a self-critical (SCST) step as two, its CIDEr-D reward computed between them. Each is captured once and replayed
for every batch of the same shapes.

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
fresh expected-context share, whose schedule is a buffer), dropout, the REINFORCE baseline's update.

An SCST step (``SelfCriticalSteps``) is the eager step cut where the host must look: CIDEr-D counts the n-grams
of the sampled captions, shapes no graph can hold. The first graph is the step's forward with autograd recording:
the rollout (all ``max_len`` words, its log-probabilities, hard attention's sampled locations and the dropout
masks saved for the backward as the eager step saves them) and the greedy baseline's captions (no gradient, eval
mode). CIDEr-D then scores the sampled tokens eagerly, and the second graph, captured on the first's memory pool,
is the self-critical loss of those rewards and its backward through the first graph's saved tensors (as
``torch.cuda.make_graphed_callables`` splits a forward from its backward). Nothing is drawn twice and nothing is
recomputed: a replayed step draws, in the same order, what the eager step draws.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Hashable

import lightning as L
import torch
import torch.distributed as dist
from torch import Tensor, nn

from captioner.config import ModelConfig
from captioner.evaluation.cider import CiderD
from captioner.model.captioner import Captioner
from captioner.model.graphs import CapturedCall, capture_state, warm_up
from captioner.model.losses import CaptionLoss, SelfCriticalLoss
from captioner.training.objectives import (
    SelfCriticalSamples,
    cross_entropy_terms,
    self_critical_rewards,
    self_critical_samples,
)

log = logging.getLogger(__name__)

# the batch's tensors a cross-entropy step reads; "tokens", the loss's normaliser under DDP (a scalar, in every step
# of a run or in none), leaves the capture's key alone
INPUTS = ("images", "features", "captions", "image_index", "caption_weights", "tokens")
Terms = dict[str, Tensor]
Replay = tuple[Terms, list[Tensor | None], Tensor | None]  # the loss terms, the gradients, their flat copy (DDP)
# the samples' rewards (B, k), the greedy captions' (B,) or None, the loss's normaliser () under DDP or None
Rewards = tuple[Tensor, Tensor | None, Tensor | None]


class StepGraphs:
    """What graphed training steps of either objective share: the ranks' agreement on replaying, the replay's
    gradients all-reduced under DDP and handed to the optimiser, the count of replayed steps. A subclass says what
    a step's capture depends on in a batch (``key_of``) and captures it (``_capture``).

    ``capture=False`` runs the same path, warm-up calls and static batch included, eagerly instead of capturing
    it (``CapturedCall``'s: what a CPU can check of the bookkeeping); on a GPU it is always True.
    """

    replays = "the CUDA graph"  # what a replayed step replays, as ``report`` says it

    def __init__(self, modules: nn.Module, capture: bool = True) -> None:
        self.modules = modules
        self.capture = capture
        self.params = [p for p in modules.parameters() if p.requires_grad]
        self.key: Hashable | None = None
        self.call: Callable[[dict], Replay] | None = None
        self.gradients: list[Tensor | None] = []  # the last replay's, one per parameter (None: not used)
        self.counts = {"replayed": 0, "eager": 0}  # steps since the last ``report``
        self.captures = 0  # steps captured (a test reads it: one per run, never one per batch)
        self._agreed: bool | None = None  # ``agree``'s answer for the batch whose step comes next
        self._group: dist.ProcessGroup | None = None  # ``_host_group``'s

    def key_of(self, batch: dict) -> Hashable:
        """What a captured step depends on in ``batch``: its tensors' shapes and dtypes, the autocast state, ..."""
        raise NotImplementedError

    def _capture(self, batch: dict) -> Callable[[dict], Replay]:
        """The step captured on ``batch``: a function of a batch of the same key that replays it."""
        raise NotImplementedError

    def agree(self, batch: dict) -> bool:
        """Whether ``step`` replays ``batch`` (the captured shapes, or the first batch: captured now), on every rank:
        under DDP the ranks take the least of their answers in one all-reduce on the host, so that all replay or
        all run eagerly. Once per batch, before its step, under the step's autocast (the capture's key holds it)."""
        takes = self.key is None or self.key_of(batch) == self.key
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
        if self.call is None:
            self.key = self.key_of(batch)
            self.call = self._capture(batch)
            self.captures += 1
        terms, grads, flat = self.call(batch)
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
        (None when there were none: an epoch of the other objective); the counts restart."""
        counts, self.counts = self.counts, {"replayed": 0, "eager": 0}
        total = counts["replayed"] + counts["eager"]
        if not total:
            return None
        share = counts["replayed"] / total
        line = f"{counts['replayed']} of {total} training steps ({share:.0%}) replayed {self.replays}"
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

    def _backward(self, loss: Tensor) -> tuple[list[Tensor | None], Tensor | None]:
        """Back-propagate ``loss`` into fresh gradients (in the graph's memory when captured), outside autocast as
        Lightning's backward; the gradients and, under DDP, their flat copy to all-reduce."""
        for param in self.params:
            param.grad = None
        with torch.autocast(loss.device.type, enabled=False):
            loss.backward()
        grads = [param.grad for param in self.params]
        distributed = dist.is_available() and dist.is_initialized()
        flat = torch.cat([g.reshape(-1) for g in grads if g is not None]) if distributed else None
        return grads, flat


class GraphedSteps(StepGraphs):
    """Cross-entropy steps of ``modules`` (the model and the loss) replayed as one CUDA graph for the batch shape
    captured first; ``terms(batch)`` is the step's loss terms (forward and loss, no backward)."""

    def __init__(self, modules: nn.Module, terms: Callable[[dict], Terms], capture: bool = True) -> None:
        super().__init__(modules, capture)
        self.terms = terms

    def key_of(self, batch: dict) -> Hashable:
        """Its tensors' shapes and dtypes, the captions' layout, the autocast state."""
        shaped = (name for name in INPUTS if name in batch and name != "tokens")
        tensors = tuple((name, tuple(batch[name].shape), batch[name].dtype) for name in shaped)
        return tensors, batch.get("captions_per_image"), capture_state(batch["captions"].device)

    def _capture(self, batch: dict) -> Callable[[dict], Replay]:
        names = [name for name in INPUTS if name in batch]
        rest = {k: v for k, v in batch.items() if k == "captions_per_image"}

        def step(*tensors: Tensor) -> Replay:
            terms = self.terms({**dict(zip(names, tensors)), **rest})
            grads, flat = self._backward(terms["loss"])
            return {k: v.detach() for k, v in terms.items()}, grads, flat

        call = CapturedCall(step, [batch[name] for name in names], keep=self.modules, capture=self.capture)
        return lambda given: call(*(given[name] for name in names))


class SelfCriticalSteps(StepGraphs):
    """SCST steps of ``modules`` (the model and the self-critical loss) replayed as two CUDA graphs for the batch
    shape captured first: ``samples(batch)``, the step's forward (``objectives.self_critical_samples`` with static
    shapes), then, after ``rewards(batch, samples)`` on the host side (CIDEr-D, and under DDP the all-reduced count of
    sampled tokens: eager), ``loss(samples, rewards, greedy_rewards, tokens, real)``, the loss terms, and their
    backward (the module docstring says how)."""

    replays = "the SCST step's two CUDA graphs"

    def __init__(
        self,
        modules: nn.Module,
        samples: Callable[[dict], SelfCriticalSamples],
        rewards: Callable[[dict, SelfCriticalSamples], Rewards],
        loss: Callable[[SelfCriticalSamples, Tensor, Tensor | None, Tensor | None, Tensor | None], Terms],
        capture: bool = True,
    ) -> None:
        super().__init__(modules, capture)
        self.samples, self.rewards, self.loss = samples, rewards, loss

    def key_of(self, batch: dict) -> Hashable:
        """The shape and dtype of its images or cached features, and of its ``real`` rows (when it has them), the
        autocast state."""
        source = batch["features" if "features" in batch else "images"]
        real = batch.get("real")
        shapes = tuple(source.shape), source.dtype, None if real is None else tuple(real.shape)
        return shapes, capture_state(source.device)

    def _capture(self, batch: dict) -> Callable[[dict], Replay]:
        name = "features" if "features" in batch else "images"
        marked = "real" in batch  # whether the batch marks its real rows (``collate``'s masked rows)

        def learn(samples: SelfCriticalSamples, rewards: Rewards, real: Tensor | None) -> Replay:
            terms = self.loss(samples, *rewards, real)
            grads, flat = self._backward(terms["loss"])
            return {k: v.detach() for k, v in terms.items()}, grads, flat

        def step() -> Rewards:
            samples = self.samples({name: batch[name]})
            rewards = self.rewards(batch, samples)
            learn(samples, rewards, batch.get("real"))
            return rewards

        source = batch[name]
        warmed = warm_up(step, self.modules, source.device, self.capture)  # the whole eager step, undone
        given = [part is not None for part in warmed[1:]]  # whether there are greedy rewards, and a normaliser

        def inputs(batch: dict, rewards: Rewards) -> list[Tensor]:
            """The second graph's inputs: the samples' rewards, the greedy captions' (greedy baseline), the loss's
            normaliser (under DDP), the batch's real rows (when it marks them)."""
            tensors = [rewards[0], *(part for part in rewards[1:] if part is not None)]
            return [*tensors, batch["real"]] if marked else tensors

        def learned(rewards: Tensor, *rest: Tensor) -> Replay:
            parts = iter(rest)
            greedy_rewards, tokens = (next(parts) if present else None for present in given)
            return learn(sampling.outputs, (rewards, greedy_rewards, tokens), next(parts) if marked else None)

        def sampled(source: Tensor) -> SelfCriticalSamples:
            return self.samples({name: source})

        sampling = CapturedCall(sampled, [source], capture=self.capture, warmed=True)
        pool = None if sampling.graph is None else sampling.graph.pool()  # the backward reads the forward's tensors
        learning = CapturedCall(learned, inputs(batch, warmed), capture=self.capture, warmed=True, pool=pool)

        def replay(given: dict) -> Replay:
            samples = sampling(given[name])
            return learning(*inputs(given, self.rewards(given, samples)))

        return replay


def graphed_training(trainer: L.Trainer) -> bool:
    """Whether ``trainer``'s run can replay its training steps as CUDA graphs: not where its precision or gradient
    accumulation needs them eager (logged)."""
    why = None
    if str(trainer.precision).startswith("16"):
        why = f"precision={trainer.precision} scales each step's loss on the host (GradScaler)"
    elif trainer.accumulate_grad_batches > 1:
        why = f"accumulate_grad_batches={trainer.accumulate_grad_batches} adds gradients across steps"
    if why is not None:
        log.info("model.graphs: training steps run eagerly, %s; decoding is graphed", why)
    return why is None


def training_graphs(model: Captioner, criterion: CaptionLoss, dtype: torch.dtype, capture: bool = True) -> GraphedSteps:
    """``model``'s cross-entropy steps (loss ``criterion``, cached features cast to ``dtype``) as CUDA graphs;
    ``capture``: ``GraphedSteps``'."""
    log.info("model.graphs: each cross-entropy training step replays one CUDA graph, and each decoding call")
    terms = functools.partial(cross_entropy_terms, model, criterion, dtype=dtype)
    return GraphedSteps(nn.ModuleList([model, criterion]), lambda batch: terms(batch=batch), capture)


def self_critical_graphs(
    model: Captioner,
    criterion: SelfCriticalLoss,
    cider: Callable[[], CiderD],
    dtype: torch.dtype,
    settings: ModelConfig,
    capture: bool = True,
    distributed: bool = False,
) -> SelfCriticalSteps | None:
    """``model``'s SCST steps (loss ``criterion``, the reward ``cider()``'s, built when the fit starts; cached
    features cast to ``dtype``; ``settings.scst`` and ``settings.decoding``) as CUDA graphs, or None where
    ``settings.static_shapes`` is false (a capture runs all ``max_len`` words; logged); ``capture``:
    ``SelfCriticalSteps``'; ``distributed``: under DDP, the loss divided by the global batch's sampled tokens."""
    if settings.static_shapes is False:
        log.info("model.graphs: SCST steps run eagerly, model.static_shapes=false (a capture runs every word)")
        return None
    log.info("model.graphs: each SCST step replays two CUDA graphs, its CIDEr-D reward scored between them")
    scst = settings.scst
    samples = functools.partial(
        self_critical_samples,
        model,
        dtype=dtype,
        scst=scst,
        decoding=settings.decoding,
        static_shapes=True,
        trim=False,
    )

    def rewards(batch: dict, drawn: SelfCriticalSamples) -> Rewards:
        return self_critical_rewards(cider(), drawn, batch["indices"], scst.samples, batch.get("real"), distributed)

    def loss(
        drawn: SelfCriticalSamples, rewards: Tensor, greedy: Tensor | None, tokens: Tensor | None, real: Tensor | None
    ) -> Terms:
        return criterion(drawn.drawn.log_probs, drawn.drawn.lengths, rewards, greedy, real, tokens)

    modules = nn.ModuleList([model, criterion])
    return SelfCriticalSteps(modules, lambda batch: samples(batch=batch), rewards, loss, capture)
