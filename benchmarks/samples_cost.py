"""What the pictures of a run (``callbacks.samples``: a sample sheet after every validation, the curves at the
end) cost, against the wall time of the same fit.

Runs ``python train.py`` (the demo unless overrides say otherwise) in a subprocess and reads the line the
callback prints when the fit ends: the seconds spent decoding and drawing, and the fit's wall time, both
taken in that one process, so a machine shared with other work slows both alike (the ratio is what to read,
not the seconds)::

    python benchmarks/samples_cost.py                              # the demo, 1 epoch
    python benchmarks/samples_cost.py --epochs 2 +trainer.limit_train_batches=20

With ``+trainer.limit_train_batches`` below the demo's batches per epoch, the epoch is shorter than the
demo's while a sheet costs the same (four images, whatever the epoch), so the share printed is an upper
bound of the demo's.
"""

from __future__ import annotations

import argparse
import re
import tempfile

from train_process import run_train

COST = re.compile(r"pictures: ([\d.]+) s for (\d+) sample sheets and the curves, ([\d.]+) % of the fit's ([\d.]+) s")


def main(argv: list[str] | None = None) -> None:
    """Run the training the arguments describe and print the pictures' cost."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=1, help="epochs to train (default: 1)")
    parser.add_argument("overrides", nargs="*", help="train.py overrides (key=value)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="samples-cost-") as out:
        overrides = [
            f"trainer.max_epochs={args.epochs}",
            "test=false",
            "trainer.enable_progress_bar=false",
            f"hydra.run.dir={out}/run",
            *args.overrides,
        ]
        found = run_train(overrides, COST)
    seconds, sheets, share, wall = float(found[1]), int(found[2]), float(found[3]), float(found[4])
    print(f"{'epochs':>6} {'sheets':>6} {'pictures s':>10} {'per sheet s':>11} {'fit wall s':>10} {'share %':>8}")
    each = seconds / max(sheets, 1)
    print(f"{args.epochs:>6} {sheets:>6} {seconds:>10.2f} {each:>11.2f} {wall:>10.1f} {share:>8.2f}")


if __name__ == "__main__":
    main()
