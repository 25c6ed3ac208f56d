"""A run's folder: claimed new by the first process, holding the composed config, marked when the run fails or is
stopped."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from captioner.training.run_folder import (
    RANK_VARIABLES,
    JobsFailed,
    NewRunFolder,
    first_process,
    mark_failed,
    mark_stopped,
    print_config_tree,
)
from conftest import compose_plain


def test_the_config_is_printed_as_a_tree_and_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = compose_plain([], tmp_path)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # rich is not installed
    print_config_tree(plain, tmp_path / "run")
    printed = capsys.readouterr().out
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert printed == f"config (saved as {tmp_path / 'run' / 'config.yaml'}):\n{saved}\n"
    assert yaml.safe_load(saved) == plain  # resolved: no ${...} left
    assert "${" not in saved
    sections = [line.split(":")[0] for line in saved.splitlines() if line and not line.startswith(" ")]
    assert sections[:6] == ["data", "model", "trainer", "callbacks", "logger", "paths"]
    assert set(sections) == set(plain)
    monkeypatch.setenv("LOCAL_RANK", "1")  # a DDP worker neither prints nor writes
    print_config_tree(plain, tmp_path / "worker")
    assert capsys.readouterr().out == "" and not (tmp_path / "worker").exists()


def test_the_config_tree_is_drawn_with_rich_when_installed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("rich")
    plain = compose_plain([], tmp_path)
    print_config_tree(plain, tmp_path)
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"config (saved as {tmp_path / 'config.yaml'}):", "config"]
    branches = [line[4:].split(":")[0].strip() for line in lines if line.startswith(("├── ", "└── "))]
    first = ["data", "model", "trainer", "callbacks", "logger", "paths"]
    assert branches == first + [key for key in plain if key not in first]
    assert any("beam_size: 3" in line for line in lines) and "seed: 0" in " ".join(lines)
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == plain


def test_a_failed_run_says_so_in_its_log_and_its_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)
    logging.getLogger().addHandler(handler)
    try:
        mark_failed(tmp_path, "RuntimeError: boom")
        monkeypatch.setenv("RANK", "1")  # another rank of the run writes nothing
        mark_failed(tmp_path / "rank1", "RuntimeError: boom")
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    assert (tmp_path / "FAILED").read_text() == "RuntimeError: boom\n"
    assert log_file.read_text() == "run failed: RuntimeError: boom\n"
    assert not (tmp_path / "rank1").exists()


def test_a_stopped_run_says_so_and_a_sweep_ends_with_its_failed_and_stopped_jobs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for job in ("0", "1", "2", "10"):
        (tmp_path / job).mkdir()
    mark_stopped(tmp_path / "10", "training stopped by SIGTERM at epoch 1, step 9; ... resume it with ...")
    mark_failed(tmp_path / "2", "RuntimeError: boom")
    mark_stopped(tmp_path / "1", "run stopped by SIGINT, before its first checkpoint: nothing to resume, run it again")
    assert not (tmp_path / "1" / "FAILED").exists() and not (tmp_path / "10" / "FAILED").exists()
    with pytest.raises(JobsFailed) as ended:
        NewRunFolder().on_multirun_end(OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}}))
    assert ended.value.code == 2
    assert ended.value.message.splitlines() == [
        "run stopped by SIGINT, before its first checkpoint: nothing to resume, run it again",
        "RuntimeError: boom",
        "training stopped by SIGTERM at epoch 1, step 9; ... resume it with ...",
    ]
    assert capsys.readouterr().out.splitlines() == [
        f"job 1 of the sweep was stopped: {tmp_path / '1' / 'STOPPED'}",
        f"job 2 of the sweep failed: {tmp_path / '2' / 'FAILED'}",
        f"job 10 of the sweep was stopped: {tmp_path / '10' / 'STOPPED'}",
    ]


@pytest.mark.parametrize("variable", RANK_VARIABLES)
def test_only_the_process_that_started_the_run_is_the_first(variable: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert first_process()
    monkeypatch.setenv(variable, "0")
    assert first_process()
    monkeypatch.setenv(variable, "1")
    assert not first_process()


@pytest.mark.parametrize("experiment", ["demo", "demo_scst"])
def test_the_callbacks_config_names_the_run_files_and_metrics_their_owners_write(
    experiment: str, tmp_path: Path
) -> None:
    """conf/callbacks (YAML, which cannot import) agrees with captioner.run_files and training.metrics."""
    from captioner.run_files import CHECKPOINT_DIR, LAST_CHECKPOINT
    from captioner.training.metrics import MONITORS

    callbacks = compose_plain([f"experiment={experiment}"], tmp_path)["callbacks"]
    output_dir = tmp_path / "out"
    for name in ("model_checkpoint", "last_checkpoint"):
        assert Path(callbacks[name]["dirpath"]) == output_dir / CHECKPOINT_DIR
    assert callbacks["last_checkpoint"]["filename"] + ".ckpt" == LAST_CHECKPOINT
    monitored = [node["monitor"] for node in callbacks.values() if node and node.get("monitor")]
    assert monitored and set(monitored) <= set(MONITORS)
