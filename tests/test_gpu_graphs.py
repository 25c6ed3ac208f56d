"""CUDA graphs of whole calls (``model.graphs``; skipped without a CUDA device, run on a lent GPU by
``python benchmarks/gpu_check.py``): a replayed decoding call equals the eager one for every method, and still
after the decoder is moved, cast or given new tensors (never replaying freed memory), a replayed
training step equals the eager step over 20 steps in bf16, 20 replayed SCST steps (two graphs each, CIDEr-D scored
between them) equal the eager steps from the same weights and random draws, hard attention's replays draw fresh
locations with eager's statistics and follow the expected-context schedule, Lightning trains with the graphs
as without, on a COCO-shaped set too (every step replayed), and the fused attention read (``model.fused_attention``)
inside a captured step gives eager's loss and gradients.
tests/test_graphed.py and tests/test_scst_graphs.py check on the CPU what runs there of the same path."""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from captioner.config import DecodingConfig
from captioner.data.dataset import CaptionDataset, build_transform, collate
from captioner.model.decoding import decode
from captioner.model.graphs import CapturedCall, tensors_at
from captioner.training.graphed import GraphedSteps, self_critical_graphs
from captioner.training.objectives import cross_entropy_terms
from captioner.training.optimization import build_optimizer
from conftest import V, features_for, make_decoder
from test_gpu import fit_on_gpu
from test_precision import one_batch, tiny_module
from test_scst_graphs import adam, scst_batch, scst_module, toy_cider
from test_static_batches import MAX_LEN, SIZE, coco_shaped

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")
METHODS = {
    "greedy": DecodingConfig(method="greedy", max_len=8),
    "greedy, constrained": DecodingConfig(method="greedy", max_len=8, min_len=3, no_repeat_ngram_size=2),
    "beam 3": DecodingConfig(method="beam", beam_size=3, max_len=8),
    "beam 3, constrained": DecodingConfig(
        method="beam", beam_size=3, max_len=8, length_penalty=0.7, min_len=3, no_repeat_ngram_size=2
    ),
    "beam 5": DecodingConfig(method="beam", beam_size=5, max_len=8),
    "beam 4, n-best 3": DecodingConfig(method="beam", beam_size=4, n_best=3, max_len=8, min_len=3),
    "diverse 6 in 3 groups, n-best 6": DecodingConfig(
        method="diverse", beam_size=6, groups=3, diversity=1.0, n_best=6, max_len=8, no_repeat_ngram_size=2
    ),
}


def n_best_equal(mine, theirs) -> None:
    for field in ("n_best_tokens", "n_best_lengths"):
        assert (getattr(mine, field) is None) == (getattr(theirs, field) is None), field
        assert getattr(mine, field) is None or torch.equal(getattr(mine, field), getattr(theirs, field)), field
    if mine.n_best_scores is not None:
        torch.testing.assert_close(mine.n_best_scores, theirs.n_best_scores, rtol=1e-4, atol=1e-4)


def generations_equal(mine, theirs) -> None:
    assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.lengths, theirs.lengths)
    torch.testing.assert_close(mine.scores, theirs.scores, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mine.alphas, theirs.alphas, rtol=1e-4, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("name", list(METHODS))
def test_a_replayed_decoding_call_equals_the_eager_one(name: str, attention: str) -> None:
    decoder, settings = make_decoder(attention).to(CUDA), METHODS[name]
    graphs = decoder.decoding_graphs
    for batch in (4, 4, 3):  # a second call of one shape replays; another batch size captures again
        features = features_for(batch, seed=batch).to(CUDA)
        graphed = decode(decoder, features, settings)
        decoder.decoding_graphs = None
        eager = decode(decoder, features, settings)
        decoder.decoding_graphs = graphs
        generations_equal(graphed, eager)
        n_best_equal(graphed, eager)
    assert graphs.captures == 2


def half_float(decoder: torch.nn.Module) -> None:
    decoder.half().float()


def new_tensors(decoder: torch.nn.Module) -> None:
    decoder.load_state_dict(copy.deepcopy(decoder.state_dict()), assign=True)


@needs_cuda
@pytest.mark.parametrize(
    "change", [lambda decoder: decoder.cpu().cuda(), half_float, new_tensors], ids=["moved", "cast", "assigned"]
)
def test_a_decoder_moved_cast_or_given_new_tensors_never_replays_the_old_ones(change) -> None:
    decoder, settings = make_decoder().to(CUDA), METHODS["beam 3, constrained"]
    features = features_for(4).to(CUDA)
    decode(decoder, features, settings)  # captured on the tensors as they are now
    old = [t.detach() for t in itertools.chain(decoder.parameters(), decoder.buffers())]  # kept: the new go elsewhere
    change(decoder)
    now = {address for address, _, _ in tensors_at(decoder)}
    left = [tensor for tensor in old if tensor.data_ptr() not in now]
    assert left
    for tensor in left:
        tensor.fill_(float("nan"))  # what the freed memory holds once something else is allocated there
    graphed = decode(decoder, features, settings)
    graphs, decoder.decoding_graphs = decoder.decoding_graphs, None
    eager = decode(decoder, features, settings)
    decoder.decoding_graphs = graphs
    generations_equal(graphed, eager)
    assert graphs.captures == 2 and len(graphs.calls) == 1


@needs_cuda
@pytest.mark.parametrize("cuts", [{}, {"top_k": 4, "top_p": 0.9}])
def test_replayed_sampling_draws_fresh_words_as_eager_draws_them(cuts: dict) -> None:
    decoder, settings = make_decoder().to(CUDA), DecodingConfig(method="sample", max_len=8, **cuts)
    features = features_for(1024).to(CUDA)
    first, second = decode(decoder, features, settings), decode(decoder, features, settings)  # capture, replay
    assert not torch.equal(first.tokens, second.tokens)  # each replay draws its own words
    graphs, decoder.decoding_graphs = decoder.decoding_graphs, None
    eager = decode(decoder, features, settings)
    decoder.decoding_graphs = graphs
    # the same distribution: the captions' mean log-probability within 6 standard errors
    spread = eager.scores.std() / len(eager.scores) ** 0.5
    assert abs(second.scores.mean() - eager.scores.mean()) < 6 * spread
    assert graphs.captures == 1


@needs_cuda
def test_hard_attention_replays_sample_fresh_locations_on_the_schedule() -> None:
    decoder = make_decoder("hard").to(CUDA).train()
    features, tokens = features_for(2048).to(CUDA), torch.randint(4, V, (2048, 9), device=CUDA)

    def sample(features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        output = decoder(features, tokens)
        return output.location_log_probs, output.sampled

    call = CapturedCall(torch.no_grad()(sample), [features, tokens])
    decoder.hard_expectation_prob = 0.25  # the schedule's share now: a quarter read the expected context
    first = [t.clone() for t in call(features, tokens)]
    second = call(features, tokens)
    assert not torch.equal(first[0], second[0])  # fresh locations each replay
    share = 1 - first[1].float().mean().item()
    assert abs(share - 0.25) < 4 * (0.25 * 0.75 / 2048) ** 0.5
    with torch.no_grad():
        eager = sample(features, tokens)
    sampled = first[1] & eager[1]  # rows that sampled in both: the mean log-probability of the sampled locations
    graphed_mean, eager_mean = first[0][first[1]].mean(), eager[0][eager[1]].mean()
    spread = eager[0][sampled].std() / sampled.sum() ** 0.5
    assert abs(graphed_mean - eager_mean) < 6 * spread
    decoder.hard_expectation_prob = 1.0
    assert not call(features, tokens)[1].any()  # the share is a buffer the replay reads, not a captured constant


def cuda_batch(seed: int, channels: int) -> dict:
    """``one_batch`` with features of ``seed``, on the GPU."""
    torch.manual_seed(seed)
    batch = one_batch(channels)
    batch["features"] = torch.randn_like(batch["features"])
    return {k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


@needs_cuda
def test_twenty_replayed_training_steps_equal_eager_steps_in_bf16() -> None:
    eager = tiny_module().to(CUDA).train()
    graphed = copy.deepcopy(eager)
    channels = eager.model.encoder.out_channels
    batches = [cuda_batch(seed, channels) for seed in range(20)]
    steps = GraphedSteps(
        torch.nn.ModuleList([graphed.model, graphed.criterion]),
        lambda batch: cross_entropy_terms(graphed.model, graphed.criterion, batch, torch.float32),
    )
    optimizers = [
        build_optimizer([p for p in m.parameters() if p.requires_grad], [], m.settings.optimizer)
        for m in (eager, graphed)
    ]
    losses = [[], []]
    for batch in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            terms = cross_entropy_terms(eager.model, eager.criterion, batch, torch.float32)
            replayed = steps.step(batch)
        optimizers[0].zero_grad()
        terms["loss"].backward()
        optimizers[1].zero_grad()
        steps.attach_gradients()
        for module, optimizer in zip((eager, graphed), optimizers):
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 1.0)
            optimizer.step()
        losses[0].append(terms["loss"].item())
        losses[1].append(replayed["loss"].item())
    torch.testing.assert_close(torch.tensor(losses[1]), torch.tensor(losses[0]), rtol=2e-2, atol=2e-2)
    assert losses[0][-1] < losses[0][0]  # it learns
    for mine, theirs in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=2e-2, atol=2e-3)
    assert steps.counts == {"replayed": 20, "eager": 0}


@needs_cuda
@pytest.mark.parametrize(
    ("attention", "baseline", "precision"),
    [("soft", "mean", torch.float32), ("hard", "greedy", torch.float32), ("soft", "mean", torch.bfloat16)],
)
def test_twenty_replayed_scst_steps_equal_eager_steps(attention: str, baseline: str, precision: torch.dtype) -> None:
    """Each step draws from the same random state in both (dropout, the sampled words, hard attention's locations):
    the replay's draws are the eager step's, so the rewards are the same numbers, not the same distribution."""
    eager = scst_module(attention=attention, baseline=baseline).to(CUDA).train()
    graphed = copy.deepcopy(eager)
    eager.cider = graphed.cider = toy_cider(eager.vocab, CUDA)
    steps = self_critical_graphs(
        graphed.model, graphed.self_critical, lambda: graphed.cider, torch.float32, graphed.settings
    )
    channels = eager.model.encoder.out_channels
    batches = [scst_batch(seed, channels, masked=2 if seed % 5 == 4 else 0) for seed in range(20)]
    batches = [{k: v.to(CUDA) if isinstance(v, torch.Tensor) else v for k, v in batch.items()} for batch in batches]
    optimizers = adam(eager), adam(graphed)
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=precision == torch.bfloat16)
    seen = {"eager": [], "graphed": []}  # (reward, loss) of each step
    for batch in batches:
        state = torch.cuda.get_rng_state()
        with autocast():
            terms = eager.self_critical_terms(batch)
        optimizers[0].zero_grad()
        terms["loss"].backward()
        torch.cuda.set_rng_state(state)  # the replay draws from where the eager step did
        with autocast():
            replayed = steps.step(batch)
        optimizers[1].zero_grad()
        steps.attach_gradients()
        for module, optimizer in zip((eager, graphed), optimizers):
            torch.nn.utils.clip_grad_norm_([p for p in module.parameters() if p.requires_grad], 5.0)
            optimizer.step()
        seen["eager"].append([terms["reward"].item(), terms["loss"].item()])
        seen["graphed"].append([replayed["reward"].item(), replayed["loss"].item()])
    assert steps.counts == {"replayed": 20, "eager": 0} and steps.captures == 1
    tolerance = {"rtol": 1e-4, "atol": 1e-5} if precision == torch.float32 else {"rtol": 1e-2, "atol": 1e-3}
    torch.testing.assert_close(torch.tensor(seen["graphed"]), torch.tensor(seen["eager"]), **tolerance)
    assert len({reward for reward, _ in seen["eager"]}) > 10  # the steps drew different captions
    for mine, theirs in zip(graphed.parameters(), eager.parameters()):
        torch.testing.assert_close(mine, theirs, **tolerance)


class Lines(logging.Handler):
    """The messages logged to it (gpu_check runs pytest without its logging plugin, so without ``caplog``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@needs_cuda
def test_lightning_trains_with_graphed_steps_as_without() -> None:
    weights, lines = [], Lines()
    logger = logging.getLogger("captioner.training.module")
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    for graphs in (False, True):
        module = tiny_module(graphs=graphs)
        channels = module.model.encoder.out_channels
        batches = [one_batch(channels) for _ in range(6)]
        batches[-1] = {k: v[:2] if k == "features" else v for k, v in batches[-1].items()}  # a smaller last batch
        batches[-1] |= {"captions": batches[-1]["captions"][:4], "image_index": batches[-1]["image_index"][:4]}
        fit_on_gpu(module, batches, "bf16-mixed", clip=1.0)
        weights.append(torch.cat([p.detach().float().flatten() for p in module.parameters()]))
    logger.removeHandler(lines)
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-3, atol=1e-4)
    assert "5 of 6 training steps (83%) replayed the CUDA graph; 1 ran eagerly: their batch had other shapes" in (
        " ".join(lines.lines)
    )


@needs_cuda
def test_the_coco_shaped_set_replays_every_step_and_trains_as_eager_steps(tmp_path: Path) -> None:
    """tests/test_static_batches.py's COCO-shaped set (5 to 7 captions per image, a corrupt and a missing image) in
    static batches of K = 5 captions per image: every step replays, and trains as the eager steps do."""
    module = tiny_module()
    dataset = CaptionDataset(coco_shaped(tmp_path), module.vocab, build_transform(SIZE, train=False), max_len=MAX_LEN)
    static = functools.partial(collate, pad_to=MAX_LEN + 2, captions_per_image=5, rows=3)  # 16 = 5 x 3 + 1
    torch.manual_seed(0)  # the draws of the images with more than five captions
    batches = [{**b, "skipped": []} for b in DataLoader(dataset, batch_size=3, shuffle=True, collate_fn=static)]
    assert len(batches) == 6 and {tuple(b["captions"].shape) for b in batches} == {(15, MAX_LEN + 2)}
    weights, replays = [], []
    for graphs in (False, True):
        module = tiny_module(graphs=graphs)
        trainer = fit_on_gpu(module, batches, "bf16-mixed", clip=1.0)
        weights.append(torch.cat([p.detach().float().flatten() for p in module.parameters()]))
        replays.append(trainer.callback_metrics.get("train/graph_replays"))
    torch.testing.assert_close(weights[1], weights[0], rtol=1e-3, atol=1e-4)
    assert replays[0] is None and replays[1].item() == 1.0  # the last, short batch padded with masked rows


@needs_cuda
@pytest.mark.parametrize("precision", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_attention_inside_a_captured_step_equals_the_eager_attention(precision: torch.dtype) -> None:
    """``model.fused_attention``: inductor's Triton kernels of the additive read, compiled in the warm-up and
    replayed inside the training step's CUDA graph, give the eager read's loss and gradients, batch after batch (bf16:
    each gradient within 2 % of eager's in norm); a replayed beam search with them decodes eager's captions."""
    eager = tiny_module().to(CUDA).train()
    fused = tiny_module(fused_attention=True).to(CUDA).train()
    fused.load_state_dict(eager.state_dict())
    assert fused.model.decoder.attention.fused
    steps = GraphedSteps(
        torch.nn.ModuleList([fused.model, fused.criterion]),
        lambda batch: cross_entropy_terms(fused.model, fused.criterion, batch, torch.float32),
    )
    close = {"rtol": 1e-4, "atol": 1e-5} if precision == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16, enabled=precision == torch.bfloat16)
    for seed in range(4):  # the capture, then replays of other batches
        batch = cuda_batch(seed, eager.model.encoder.out_channels)
        eager.zero_grad(set_to_none=True)
        with autocast():
            terms = cross_entropy_terms(eager.model, eager.criterion, batch, torch.float32)
            replayed = steps.step(batch)
        terms["loss"].backward()
        fused.zero_grad(set_to_none=True)
        steps.attach_gradients()
        torch.testing.assert_close(replayed["loss"], terms["loss"], **close)
        for (name, mine), theirs in zip(fused.named_parameters(), eager.parameters()):
            assert (mine.grad is None) == (theirs.grad is None), name
            if theirs.grad is None:
                continue
            if precision == torch.float32:
                torch.testing.assert_close(mine.grad, theirs.grad, **close, msg=lambda m, name=name: f"{name}: {m}")
            else:  # the fused kernels keep the energies in fp32 between ops, eager rounds them to bf16 at each one
                assert (mine.grad - theirs.grad).norm() <= 2e-2 * theirs.grad.norm() + 1e-6, name
    assert steps.counts == {"replayed": 4, "eager": 0}
    torch.manual_seed(4)
    features = torch.randn(4, 9, eager.model.encoder.out_channels, device=CUDA)  # (B, L, C)
    decoders = [module.model.decoder.eval() for module in (eager, fused)]
    decoders[0].decoding_graphs = None
    with torch.no_grad():  # fp32: bf16's near ties could pick other beams
        generations_equal(*(decode(decoder, features, METHODS["beam 3"]) for decoder in reversed(decoders)))
    assert decoders[1].decoding_graphs.captures == 1
