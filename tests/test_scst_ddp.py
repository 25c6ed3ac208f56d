"""Self-critical training under DDP weighs every sampled token of the global batch alike: two gloo ranks whose
captions differ in number and length (one with a padded image) average their gradients, as DDP does, into the
gradient one process computes over both batches; without the shared normaliser (each rank dividing by its own
tokens) they would not. Run as a script, the file is the two ranks (``python tests/test_scst_ddp.py OUT``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from captioner.model.losses import SelfCriticalLoss
from captioner.training.objectives import sampled_token_share
from conftest import subprocess_env

K = 2  # samples per image
T = 6  # sampled steps
# per rank: the images' sampled caption lengths (B*k,), whether each image is real (B,)
RANKS = [
    {"lengths": [6, 2, 5, 4, 1, 3], "real": [True, True, False]},  # three images, the last a padded row
    {"lengths": [1, 2], "real": [True]},  # one image, short captions
]


def rank_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s sampled log-probabilities (B*k, T), lengths, rewards (B, k) and real rows, seeded by rank."""
    generator = torch.Generator().manual_seed(rank)
    lengths = torch.tensor(RANKS[rank]["lengths"])
    real = torch.tensor(RANKS[rank]["real"])
    steps = torch.arange(T) < lengths.unsqueeze(1)
    log_probs = -torch.rand(len(lengths), T, generator=generator).where(steps, 0.0)
    rewards = torch.rand(len(real), K, generator=generator)
    return {"log_probs": log_probs, "lengths": lengths, "rewards": rewards, "real": real}


def gradient(batch: dict[str, torch.Tensor], tokens: torch.Tensor | None) -> torch.Tensor:
    """The gradient of the mean-baseline SCST loss with respect to the batch's log-probabilities."""
    log_probs = batch["log_probs"].clone().requires_grad_()
    loss = SelfCriticalLoss("mean")(log_probs, batch["lengths"], batch["rewards"], real=batch["real"], tokens=tokens)
    loss["loss"].backward()
    return log_probs.grad


def one_process() -> list[torch.Tensor]:
    """Each rank's rows of the gradient one process takes over both ranks' batches together."""
    batches = [rank_batch(rank) for rank in range(len(RANKS))]
    together = {name: torch.cat([batch[name] for batch in batches]) for name in batches[0]}
    return list(gradient(together, None).split([len(batch["lengths"]) for batch in batches]))


def _rank(rank: int, out: str, shared: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out}/rendezvous", rank=rank, world_size=len(RANKS))
    batch = rank_batch(rank)
    tokens = sampled_token_share(batch["lengths"], batch["real"], K) if shared else None
    grad = gradient(batch, tokens) / len(RANKS)  # DDP: the mean of the ranks' gradients, each rank's own rows
    Path(out, f"rank{rank}-{shared}.json").write_text(json.dumps(grad.tolist()))
    dist.destroy_process_group()


def run_ranks(out: Path, shared: bool) -> list[torch.Tensor]:
    """The gradient rows of two gloo ranks (``shared``: with ``sampled_token_share``; else each its own tokens)."""
    script = [sys.executable, __file__, str(out), str(shared)]
    subprocess.run(script, check=True, timeout=120, capture_output=True, env=subprocess_env())
    return [torch.tensor(json.loads(Path(out, f"rank{rank}-{shared}.json").read_text())) for rank in range(2)]


@pytest.mark.slow
def test_two_ranks_with_the_shared_normaliser_take_the_one_process_gradient(tmp_path: Path) -> None:
    expected = one_process()
    for rank, rows in enumerate(run_ranks(tmp_path / "shared", shared=True)):
        torch.testing.assert_close(rows, expected[rank])
    apart = run_ranks(tmp_path / "apart", shared=False)  # each rank over its own tokens: the short rank weighs more
    assert not torch.allclose(apart[1], expected[1], rtol=0.05)


def test_one_process_gradient_weighs_each_real_token_once() -> None:
    (first, second) = one_process()
    # 6 + 2 + 5 + 4 (the padded image's 1 + 3 left out) + 1 + 2 = 20 real sampled tokens
    assert int((first != 0).sum() + (second != 0).sum()) == 20
    assert torch.equal(first[4:], torch.zeros(2, T))  # the padded image's samples count nowhere


if __name__ == "__main__":
    out, shared = Path(sys.argv[1]), sys.argv[2] == "True"
    out.mkdir(parents=True, exist_ok=True)
    torch.multiprocessing.start_processes(_rank, args=(str(out), shared), nprocs=len(RANKS), start_method="fork")
