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

from captioner.config import Compile, DecodingConfig, ModelConfig, from_dict
from captioner.model.decoder import ShowAttendTellDecoder
from captioner.model.decoding import beam_search, greedy, rollout, sample
from conftest import V, features_for, make_decoder, run_train, tiny_overrides

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


def test_compiled_training_equals_eager_and_compiles_once_for_every_caption_length(compiled_pair):
    compiled, eager = compiled_pair
    before = counters["stats"]["unique_graphs"]
    for length, captions in ((5, 10), (9, 10), (3, 10), (12, 10), (7, 6)):  # the last batch is smaller
        tokens = torch.randint(4, V, (captions, length), generator=torch.Generator().manual_seed(length))
        features = features_for(captions // 2, seed=length)
        image_index = torch.arange(captions) // 2
        losses = []
        for decoder in (compiled, eager):
            decoder.zero_grad()
            output = decoder(features, tokens, image_index)
            loss = torch.nn.functional.cross_entropy(output.logits.reshape(-1, V), tokens[:, 1:].reshape(-1))
            loss.backward()
            losses.append(loss)
        torch.testing.assert_close(losses[0], losses[1])
        for (name, mine), theirs in zip(compiled.named_parameters(), eager.parameters()):
            torch.testing.assert_close(mine.grad, theirs.grad, msg=name)
    assert counters["stats"]["unique_graphs"] - before == 1


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


def test_compile_reads_old_true_false_and_turns_off():
    assert from_dict(ModelConfig, {"compile": True}).compile == Compile.default
    assert from_dict(ModelConfig, {"compile": False}).compile == Compile.off
    assert from_dict(ModelConfig, {"compile": "reduce-overhead"}).compile == Compile.reduce_overhead
    assert ModelConfig().compile is None  # reduce-overhead on CUDA, off elsewhere
    decoder = make_decoder()
    decoder.compile_step(Compile.default)
    assert decoder.compiled_step is not None
    decoder.compile_step(Compile.off)
    assert decoder.compiled_step is None


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
