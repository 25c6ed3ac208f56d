"""Everything a lent GPU has to check, in one command and one report: the GPU-only tests, the demo, and the
tables of docs/performance.md.

    python benchmarks/gpu_check.py              # on a GPU machine prepared as ../shared/gpu/README.md says

Runs, each in its own process, with its wall time: ``pytest tests/test_gpu.py tests/test_gpu_graphs.py
tests/test_gpu_decoding.py`` (CUDA graphs of whole decoding calls and training steps, cross-entropy and SCST,
against eager, the per-word reduce-overhead step, 16-mixed and bf16-mixed steps with clipping and an empty batch,
nvjpeg against the CPU's JPEG decoder); ``python train.py trainer=gpu`` (the demo, CUDA graphs on by default, its
SCST steps too: its wall time, BLEU-4 and each epoch's share of replayed steps); ``benchmarks/coco_shaped.py``
(``train.py trainer=ddp trainer.devices=1`` on a COCO-shaped set, 5 to 7 captions per image and unreadable files,
for two epochs: cross-entropy, then SCST, each with graphed steps whose gradients are all-reduced beside the
graph);
``benchmarks/train_step.py`` in bf16 (the training step and the decoder-only step, eager and graphed);
``benchmarks/captioning.py`` in bf16 (greedy, beam 3 and beam 5 against the encoder alone, beam 3 at batch 1 to
128, each call one replay); ``benchmarks/data_loading.py`` (the loader's images/s against what the step consumes);
``benchmarks/profile_ops.py`` (the top kernels of the graphed steps and of beam search);
``benchmarks/fused_attention.py`` (the decoder-only step with the attention read eager and fused by inductor, eager
and graphed, and each read's top kernels). The tables carry peak memory and FLOP/s against the card's measured bf16
matmul rate. Its whole output is what docs/gpu_report.md takes, pasted. Without a CUDA device it prints one line on
stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BENCH = ["--device", "cuda", "--precision", "bf16"]
NO_PLUGINS = ["-p", "no:cacheprovider", "-p", "no:logging"]  # no log capture: torch's debug lines hid the failures
# one DDP process with graphed steps (model.graphs unset: on for CUDA) on the COCO-shaped set (5 to 7 captions per
# image, unreadable files) that coco_shaped.py writes and trains on: a cross-entropy epoch, then an SCST one
DDP = ["benchmarks/coco_shaped.py", "data/coco_shaped", "trainer=ddp", "trainer.devices=1", "test=false"]
TRAINING = ("train.py", DDP[0])  # the parts whose output is train.py's
TESTS = ["tests/test_gpu.py", "tests/test_gpu_graphs.py", "tests/test_gpu_decoding.py"]
# (title, arguments of python, seconds at most): each about 1.4x the part's wall time on the H100 with cold caches
# (docs/gpu_report.md: 71, over 120, 45, 94, 32, 44, 34 s); together ten and a half minutes, the demo's the largest
# (measured with its SCST epochs eager; graphed since, not measured yet), for about eight minutes of running
PARTS = [
    ("GPU-only tests", ["-m", "pytest", *TESTS, "-q", "-rA", "--tb=short", *NO_PLUGINS], 100),
    ("The demo: python train.py trainer=gpu", ["train.py", "trainer=gpu"], 180),
    ("DDP on a COCO-shaped set, one process, graphed steps: python " + " ".join(DDP), DDP, 90),
    ("Training step", ["benchmarks/train_step.py", *BENCH, "--channels-last"], 130),
    ("Captioning", ["benchmarks/captioning.py", *BENCH], 50),
    ("Data loading", ["benchmarks/data_loading.py", *BENCH], 60),
    ("Profile", ["benchmarks/profile_ops.py", *BENCH, "--channels-last", "--rows", "12"], 50),
    ("Fused attention", ["benchmarks/fused_attention.py", *BENCH, "--rows", "12"], 180),
]
BLEU4 = re.compile(r"BLEU-4 ([0-9.]+)")  # the first is validation's, in train.py's summary
SUMMARY = "validation BLEU"  # where train.py's summary starts: the demo's report prints it on
REPLAYS = re.compile(r"\d+ of \d+ training steps \(\d+%\) replayed [^\n]*")  # an epoch's graphed steps (module's log)


def run_part(title: str, args: list[str], limit: int) -> bool:
    """Run one part, print its output under its title with its wall time; whether it succeeded."""
    print(f"\n## {title}\n\n$ python {' '.join(args)}", flush=True)
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired as exc:
        partial = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else exc.stdout or ""
        print(f"{partial[-4000:]}\n-> FAILED: timed out after {limit} s", flush=True)
        return False
    seconds = time.perf_counter() - start
    output = proc.stdout
    if args[0] in TRAINING and SUMMARY in output:
        output = output[output.index(SUMMARY) :]  # the config tree and the epochs' lines are the run folder's
    if proc.returncode != 0:
        output = proc.stdout[-20000:] + proc.stderr[-8000:]
    print(output.rstrip())
    replays = REPLAYS.findall(proc.stdout + proc.stderr) if args[0] in TRAINING else []
    if replays:
        print("CUDA graph replays, epoch by epoch:\n" + "\n".join(f"  {line}" for line in replays))
    bleu = BLEU4.findall(proc.stdout) if args[0] in TRAINING else []
    summary = f"val BLEU-4 {bleu[0]}, " if bleu else ""
    print(f"-> {'ok' if proc.returncode == 0 else f'FAILED (exit {proc.returncode})'}: {summary}{seconds:.0f} s wall")
    return proc.returncode == 0


def main(argv: list[str] | None = None) -> int:
    """Run every part and print the report; 0 when all passed, 1 when one failed, 2 without CUDA."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.epilog = "parts, each with its time limit:\n" + "\n".join(
        f"  {title} ({limit} s)" for title, _, limit in PARTS
    )
    parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: gpu_check needs a CUDA device and torch sees none on this machine", file=sys.stderr)
        return 2
    print(f"# GPU check: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    start = time.perf_counter()
    results = [run_part(title, args, limit) for title, args, limit in PARTS]
    failed = [title for (title, _, _), ok in zip(PARTS, results) if not ok]
    print(f"\n# {len(PARTS) - len(failed)}/{len(PARTS)} parts passed in {time.perf_counter() - start:.0f} s")
    for title in failed:
        print(f"failed: {title}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
