"""torch.compile of the decoder's step on the CPU: one graph without breaks for every attention mode and
decoding method, compiled equals eager, one compilation across batches of other caption lengths and sizes,
and train.py with model.compile on."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch._dynamo.utils import counters

from captioner.config import Compile, DecodingConfig, ModelConfig, ScstBaseline, from_dict
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy, rollout, sample
from captioner.model.losses import SelfCriticalLoss
from conftest import V, features_for, make_decoder, make_loss, run_train, tiny_overrides

MODES = {
    "soft": {},
    "hard REINFORCE": {"attention": "hard"},
    "hard Gumbel": {"attention": "hard", "hard_estimator": "gumbel"},
    "multihead": {"scorer": "multihead", "attention_heads": 2},
}
SETTINGS = {
    "greedy": DecodingConfig(method="greedy", max_len=6),
    "sample": DecodingConfig(method="sample", max_len=6),
    "beam": DecodingConfig(method="beam", beam_size=3, max_len=6),
}


def step_inputs(decoder: ShowAttendTellDecoder, batch: int) -> tuple:
    """The inputs of one teacher-forced step for ``batch`` captions."""
    features = features_for(batch)
    expect = torch.rand(batch) < 0.5 if decoder.mode == "hard" else None
    tokens = torch.randint(4, V, (batch,))
    return decoder.embedding(tokens), decoder.init_state(features), features, decoder.attention.keys(features), expect


@pytest.mark.parametrize("mode", MODES)
def test_the_step_compiles_whole_for_training_and_every_decoding_method(mode):
    """One graph without breaks for teacher forcing (training mode: hard attention samples), and with
    fullgraph (a break would raise) for greedy, sampling, beam search and rollouts, which decode as eager does.
    Three graphs serve them all: (B, H) states without and with autograd (rollouts), beams' (B, K, H)."""
    torch._dynamo.reset()  # dynamo keeps a few compilations per code object, then runs it eagerly
    decoder = make_decoder(**MODES[mode]).train()
    explained = torch._dynamo.explain(decoder._eager_step)(*step_inputs(decoder, 3))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    decoder.eval()
    eager = copy.deepcopy(decoder)
    counter = CompileCounter()
    decoder.compiled_step = torch.compile(decoder._eager_step, backend=counter, fullgraph=True)
    for batch in (3, 5):  # the batch dimension is dynamic
        features = features_for(batch)
        for static in (False, True):
            drawn = [
                rollout(d, features, 2, SETTINGS["greedy"], torch.Generator().manual_seed(0), None, static)
                for d in (decoder, eager)
            ]
            assert torch.equal(drawn[0].tokens, drawn[1].tokens)
            assert torch.equal(drawn[0].log_probs, drawn[1].log_probs)
            for method, run in (("greedy", greedy), ("beam", beam_search)):
                outputs = [run(d, features, SETTINGS[method], static_shapes=static) for d in (decoder, eager)]
                assert torch.equal(outputs[0].tokens, outputs[1].tokens)
            outputs = [
                sample(d, features, SETTINGS["sample"], torch.Generator().manual_seed(0), None, static)
                for d in (decoder, eager)
            ]
            assert torch.equal(outputs[0].tokens, outputs[1].tokens)
    assert counter.frame_count == 3


# ----------------------------------------------------------------------------------- inductor, as trained
@pytest.fixture(scope="module")
def compiled_pair() -> tuple[ShowAttendTellDecoder, ShowAttendTellDecoder]:
    """A soft decoder whose step inductor compiles (``model.compile=default``) and its eager twin."""
    torch._dynamo.reset()
    eager = make_decoder().train()
    compiled = copy.deepcopy(eager)
    compiled.compile_step(Compile.default)
    return compiled, eager


def teacher_forced_grads(decoder: ShowAttendTellDecoder, tokens, features, image_index) -> tuple:
    """The cross-entropy of teacher forcing ``tokens`` on ``features`` and the gradients it leaves."""
    decoder.zero_grad()
    output = decoder(features, tokens, image_index)
    loss = torch.nn.functional.cross_entropy(output.logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss, {name: p.grad for name, p in decoder.named_parameters()}


def test_compiled_training_equals_eager_and_never_recompiles_across_batches(compiled_pair):
    """Both layouts (captions gathered to their image's copy, and K captions per image in the (B, K) layout)
    compile once each; then batches of other caption lengths and sizes run those two graphs: a recompilation
    would raise (``error_on_recompile``)."""
    compiled, eager = compiled_pair
    before = counters["stats"]["unique_graphs"]
    batches = [(5, 10, "gathered"), (6, 10, 2), (9, 10, "gathered"), (3, 8, 2), (12, 10, 2), (7, 6, "gathered")]
    for step, (length, captions, layout) in enumerate(batches):  # the last batch is smaller
        tokens = torch.randint(4, V, (captions, length), generator=torch.Generator().manual_seed(length))
        features = features_for(captions // 2, seed=length)
        index = torch.arange(captions) // 2 if layout == "gathered" else layout
        with torch._dynamo.config.patch(error_on_recompile=step >= 2):
            (loss, grads), (eager_loss, eager_grads) = (
                teacher_forced_grads(decoder, tokens, features, index) for decoder in (compiled, eager)
            )
        torch.testing.assert_close(loss, eager_loss)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, eager_grads[name], msg=name)
    assert counters["stats"]["unique_graphs"] - before == 2


def test_compiled_self_critical_step_equals_eager(compiled_pair):
    """SCST's rollouts (k sampled captions per image, log-probabilities kept in the graph) through the compiled
    step: the same captions, log-probabilities, loss and gradients as eager."""
    compiled, eager = compiled_pair
    rewards = torch.rand(4, 2, generator=torch.Generator().manual_seed(0))  # (B, k)
    results = []
    for decoder in (compiled, eager):
        decoder.zero_grad()
        drawn = rollout(decoder, features_for(4), 2, SETTINGS["sample"], torch.Generator().manual_seed(0), None, True)
        terms = SelfCriticalLoss(ScstBaseline.mean)(drawn.log_probs, drawn.lengths, rewards)
        terms["loss"].backward()
        results.append((drawn, terms["loss"], {name: p.grad for name, p in decoder.named_parameters()}))
    (mine, loss, grads), (theirs, eager_loss, eager_grads) = results
    assert torch.equal(mine.tokens, theirs.tokens)
    torch.testing.assert_close(mine.log_probs, theirs.log_probs)
    torch.testing.assert_close(loss, eager_loss)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)


def test_compiled_decoding_equals_eager(compiled_pair):
    compiled, eager = compiled_pair
    compiled.eval(), eager.eval()
    try:
        for batch in (4, 3):  # a last, smaller batch
            features = features_for(batch, seed=batch)
            for settings in (SETTINGS["greedy"], SETTINGS["beam"]):
                mine = (greedy if settings.method == "greedy" else beam_search)(
                    compiled, features, settings, None, True
                )
                theirs = (greedy if settings.method == "greedy" else beam_search)(eager, features, settings, None, True)
                assert torch.equal(mine.tokens, theirs.tokens)
                torch.testing.assert_close(mine.scores, theirs.scores)
    finally:
        compiled.train(), eager.train()


def test_compile_reads_old_true_false():
    assert from_dict(ModelConfig, {"compile": True}).compile == Compile.default
    assert from_dict(ModelConfig, {"compile": False}).compile == Compile.off
    assert from_dict(ModelConfig, {"compile": "reduce-overhead"}).compile == Compile.reduce_overhead
    assert ModelConfig().compile is None  # reduce-overhead on CUDA, off elsewhere


def test_compile_step_runs_the_compiled_step_and_off_runs_eager(monkeypatch):
    """``compile_step(mode)`` hands the step to torch.compile with that mode and teacher forcing runs it (equal to
    eager); ``Compile.off`` runs eagerly again: nothing reaches dynamo."""
    asked, counter, compile_ = [], CompileCounter(), torch.compile

    def recording(function, mode, fullgraph):
        asked.append((mode, fullgraph))
        return compile_(function, backend=counter, fullgraph=fullgraph)

    monkeypatch.setattr(torch, "compile", recording)
    torch._dynamo.reset()
    decoder, eager = make_decoder().train(), make_decoder().train()
    features, tokens = features_for(3), torch.randint(4, V, (6, 5), generator=torch.Generator().manual_seed(0))
    decoder.compile_step(Compile.reduce_overhead)
    assert asked == [("reduce-overhead", True)] and decoder.graphed
    decoder.compile_step(Compile.default)
    assert asked[-1] == ("default", True) and not decoder.graphed
    torch.testing.assert_close(decoder(features, tokens, 2).logits, eager(features, tokens, 2).logits)
    assert counter.frame_count == 1
    decoder.compile_step(Compile.off)
    torch._dynamo.reset()  # a step reaching dynamo would compile again
    torch.testing.assert_close(decoder(features, tokens, 2).logits, eager(features, tokens, 2).logits)
    assert counter.frame_count == 1 and len(asked) == 2


@pytest.mark.parametrize("estimator", ["reinforce", "gumbel"])
def test_compiled_hard_attention_samples_each_location_as_often_as_alpha_says(estimator):
    """Inductor draws its own random numbers, so compiled hard attention cannot draw eager's samples: over 4,000
    rows of one image and state, each location is read as often as alpha_t says (within 4 standard errors) by
    the compiled attention as by the eager one, and two calls draw different locations."""
    torch._dynamo.reset()
    decoder = make_decoder("hard", hard_estimator=estimator).train()
    rows = 4000
    features = features_for(1, seed=3).expand(rows, -1, -1)  # (R, L, D): one image
    keys = decoder.attention.keys(features)
    h = torch.randn(1, 16, generator=torch.Generator().manual_seed(4)).expand(rows, -1)  # (R, H): one state
    compiled = torch.compile(decoder._attend, fullgraph=True)
    with torch.no_grad():
        alpha = decoder.attention(keys[:1], features[:1], h[:1])[1][0]  # (L,)
        bound = 4 * (alpha * (1 - alpha) / rows).sqrt()
        for attend in (compiled, decoder._attend):
            draws = []
            for _ in range(2):
                z = attend(features, keys, h, None)[0]  # (R, D): the feature vector of each row's location
                draws.append((z.unsqueeze(1) - features[:1]).abs().sum(-1).argmin(-1))  # (R,) its location
                counts = torch.bincount(draws[-1], minlength=alpha.numel()) / rows
                assert ((counts - alpha).abs() <= bound).all(), (counts, alpha)
            assert not torch.equal(draws[0], draws[1])


def test_compiled_hard_training_step_equals_eager_with_eager_random_numbers():
    """With inductor drawing eager's random numbers (``fallback_random``), the compiled hard-attention training
    step (REINFORCE: the expectation-or-sample choice per image, the sampled locations, their log-probabilities
    and entropies) gives eager's outputs, loss and gradients under one seed."""
    torch._dynamo.reset()
    eager = make_decoder("hard", hard_expectation_prob=0.5).train()
    compiled = copy.deepcopy(eager)
    compiled.compile_step(Compile.default)
    tokens = torch.randint(4, V, (8, 6), generator=torch.Generator().manual_seed(0))
    outputs = []
    with torch._inductor.config.patch(fallback_random=True):
        for decoder in (compiled, eager):
            torch.manual_seed(0)
            output = decoder(features_for(4), tokens, 2)
            terms = make_loss()(output, tokens)
            decoder.zero_grad()
            terms["loss"].backward()
            outputs.append((output, terms, {name: p.grad for name, p in decoder.named_parameters()}))
    (mine, terms, grads), (theirs, eager_terms, eager_grads) = outputs
    assert 0 < int(mine.sampled.sum()) < 8  # some images sampled, some read the expectation
    for field in ("logits", "alphas", "location_log_probs", "entropy", "sampled"):
        torch.testing.assert_close(getattr(mine, field), getattr(theirs, field), msg=field)
    for key, value in eager_terms.items():
        torch.testing.assert_close(terms[key], value, msg=key)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, eager_grads[name], msg=name)


def test_train_py_with_compile_default_completes(tiny_shapes: Path, tmp_path: Path):
    proc = run_train(
        [
            *tiny_overrides(tiny_shapes, tmp_path),
            "model.compile=default",
            "data.image_size=64",
            "trainer.max_epochs=1",
            "+trainer.limit_train_batches=3",
            "model.objective=cross_entropy",
            "test=false",
        ]
    )
    log = proc.stdout + proc.stderr
    assert "model.compile=default: the decoder's step is compiled" in log
    assert "captions padded to data.pad_to=18 tokens" in log  # the demo's data.max_len=16, <start> and <end>
