"""The hand mutations the test suite must catch (docs/testing.md): each applied alone to a copy of the checkout,
the tests expected to see it run there, and whether they failed.

    python benchmarks/mutations.py                # every mutation, its tests on the mutated copy (~3 minutes)
    python benchmarks/mutations.py --only ds-abs  # one of them (names: --list)
    python benchmarks/mutations.py --slow         # and the end-to-end tests listed for them (train.py runs)

A mutation replaces one piece of the package's source, which must occur exactly once (tests/test_benchmarks.py
checks that it still does, so the table never names code that moved). Each row prints the tests that failed on
the mutated copy; "caught" is yes when every listed test failed. The copy holds the files git tracks, so the run
leaves the checkout alone.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tables import print_table

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutation:
    """One mistake: ``before`` in ``path`` (relative to the checkout) becomes ``after``; ``tests`` must fail."""

    name: str
    what: str  # in words, as docs/testing.md names it
    path: str
    before: str
    after: str
    tests: tuple[str, ...]  # pytest node ids (a file or file::test); those of end-to-end runs in slow
    slow: tuple[str, ...] = ()


MUTATIONS = (
    Mutation(
        "gnmt-5",
        "GNMT length penalty (5 + length) / 6 becomes / 5",
        "captioner/model/beam.py",
        "return ((5 + length) / 6) ** alpha",
        "return ((5 + length) / 5) ** alpha",
        (
            "tests/test_decoding.py::test_length_penalty_changes_the_ranking",
            "tests/test_decoding.py::test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_best_caption",
            "tests/test_decoding_constraints.py::"
            "test_a_beam_wide_enough_to_keep_every_hypothesis_finds_the_best_allowed_caption",
        ),
    ),
    Mutation(
        "ds-abs",
        "doubly stochastic penalty (1 - coverage).square() becomes .abs()",
        "captioner/model/losses.py",
        "penalty = (1.0 - coverage).square()",
        "penalty = (1.0 - coverage).abs()",
        ("tests/test_losses.py::test_doubly_stochastic_penalty",),
    ),
    Mutation(
        "uniform-max",
        "uniform-attention baseline coverage.mean() becomes .max()",
        "captioner/evaluation/correctness.py",
        "return [float(coverage.mean()) for _, coverage in",
        "return [float(coverage.max()) for _, coverage in",
        (
            "tests/test_correctness.py::test_uniform_baseline_is_the_covered_share_of_the_image",
            "tests/test_correctness.py::test_accumulator_averages_over_object_words",
            "tests/test_correctness.py::test_an_image_padded_in_twice_by_a_distributed_sampler_counts_once",
            "tests/test_correctness.py::test_state_and_merge_carry_the_accumulator_across_processes",
        ),
    ),
    Mutation(
        "logits-half",
        "attention logits times 0.5 before the softmax",
        "captioner/model/attention.py",
        "alpha = self.score(keys, h).softmax(dim=-1)",
        "alpha = (0.5 * self.score(keys, h)).softmax(dim=-1)",
        (
            "tests/test_attention.py::test_additive_is_the_papers_mlp",
            "tests/test_attention.py::test_dot_scaled_dot_and_bilinear_scores",
        ),
    ),
    Mutation(
        "reinforce-sign",
        "REINFORCE sign of hard attention (-w * ... becomes w * ...)",
        "captioner/model/losses.py",
        "return -self.reinforce_weight * (advantage * output.location_log_probs)",
        "return self.reinforce_weight * (advantage * output.location_log_probs)",
        (
            "tests/test_losses.py::test_reinforce_gradient_on_the_attention_scores_has_its_analytic_form",
            "tests/test_losses.py::test_word_reward_per_step_with_a_per_step_baseline_from_the_first_batch",
            "tests/test_attention_learning.py::test_training_moves_the_attention_onto_the_informative_cell",
        ),
    ),
    Mutation(
        "scst-sign",
        "REINFORCE sign of SCST (-(advantage * log_probs ...) loses its minus)",
        "captioner/model/losses.py",
        "loss = -(advantage * log_probs * mask).sum()",
        "loss = (advantage * log_probs * mask).sum()",
        (
            "tests/test_scst.py::test_self_critical_gradient_raises_samples_above_the_baseline_and_lowers_those_below",
            "tests/test_scst.py::test_one_self_critical_step_makes_the_better_sample_likelier_and_the_worse_less_likely",
            "tests/test_scst.py::test_self_critical_training_raises_the_greedy_captions_cider",
        ),
        ("tests/test_scst.py::test_scst_from_a_cross_entropy_run_learns_and_resumes_under_ddp",),
    ),
    Mutation(
        "temperature-inverted",
        "sampling temperature inverted (log_probs / temperature becomes *)",
        "captioner/model/decoding.py",
        "truncated(log_probs / settings.temperature,",
        "truncated(log_probs * settings.temperature,",
        (
            "tests/test_decoding_methods.py::test_sampling_at_low_temperature_is_greedy_and_reproducible_with_a_generator",
            "tests/test_decoding_sampling.py::test_every_draw_lies_inside_the_cut_and_every_word_of_it_is_drawn",
            "tests/test_decoding_constraints.py::test_blocking_repeated_bigrams",
        ),
    ),
)


def occurrences(mutation: Mutation, root: Path = ROOT) -> int:
    """How often the mutated text occurs in its file under ``root``."""
    return (root / mutation.path).read_text().count(mutation.before)


def mutated_copy(mutation: Mutation, into: Path) -> Path:
    """The files git tracks, copied under ``into`` with ``mutation`` applied; the copy's root."""
    copy = into / "checkout"
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, tracked.decode().split("\0")):
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():
            shutil.copy2(ROOT / name, copy / name)
    source = (copy / mutation.path).read_text()
    if source.count(mutation.before) != 1:
        raise SystemExit(f"error: {mutation.name}: {mutation.before!r} is not once in {mutation.path}")
    (copy / mutation.path).write_text(source.replace(mutation.before, mutation.after))
    return copy


def failed_tests(copy: Path, tests: tuple[str, ...]) -> list[str]:
    """Run ``tests`` in ``copy`` (its package first on the path); the node ids of those that failed."""
    env = {**os.environ, "PYTHONPATH": str(copy), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:xdist", *tests]
    done = subprocess.run(command, cwd=copy, env=env, capture_output=True, text=True)
    failed = re.findall(r"^(?:FAILED|ERROR) (tests/\S+?::\S+?)(?: - |$)", done.stdout, re.M)
    if done.returncode not in (0, 1):
        raise SystemExit(f"error: pytest exited {done.returncode} on {tests}:\n{done.stdout[-3000:]}{done.stderr}")
    return failed


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=[m.name for m in MUTATIONS], help="these mutations only")
    parser.add_argument("--slow", action="store_true", help="run the end-to-end tests listed for them too")
    parser.add_argument("--list", action="store_true", help="name the mutations and stop")
    args = parser.parse_args(argv)
    if args.list:
        for mutation in MUTATIONS:
            print(f"{mutation.name}: {mutation.what} ({mutation.path})")
        return
    rows = []
    for mutation in (m for m in MUTATIONS if not args.only or m.name in args.only):
        tests = mutation.tests + (mutation.slow if args.slow else ())
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as into:
            copy = mutated_copy(mutation, Path(into))
            failed = failed_tests(copy, tests)
        listed = {test: any(f == test or f.startswith(test + "[") for f in failed) for test in tests}
        names = ", ".join(f.split("::")[1] for f in failed) or "none"
        caught = "yes" if all(listed.values()) else f"NO: {sum(not v for v in listed.values())} listed passed"
        rows.append([mutation.name, mutation.what, names, caught, time.perf_counter() - start])
    print_table("hand mutations and the tests that failed on each", ["name", "mutation", "failed", "caught", "s"], rows)


if __name__ == "__main__":
    main()
