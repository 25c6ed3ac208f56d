"""The ``captioner`` command as a program: the console script streams its captions and sets the exit status,
``python -m captioner`` is the same command, ``--version``, and ``--help`` showing every default in plain text
without importing torch."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

from captioner import __version__, cli
from cli_helpers import before_summary
from conftest import ROOT


def test_console_script_streams_and_exit_status(bundles, inputs, tmp_path):
    good, missing = inputs[1][0], str(tmp_path / "missing.png")
    script = Path(sys.executable).parent / "captioner"
    proc = subprocess.run(
        [str(script), "caption", good, missing, "--model", bundles["soft"], "--max-len", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert [line.split("\t")[0] for line in proc.stdout.splitlines()] == [good]
    assert before_summary(proc.stderr, captioned=1, failed=1) == [f"error: {missing}: file not found"]


def test_python_m_captioner_is_the_command():
    proc = subprocess.run([sys.executable, "-m", "captioner", "--version"], capture_output=True, text=True, cwd=ROOT)
    assert (proc.returncode, proc.stdout) == (0, f"captioner {__version__}\n"), proc.stderr
    proc = subprocess.run([sys.executable, "-m", "captioner", "caption"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "the following arguments are required: --model" in proc.stderr


def test_version_and_help_show_every_default_in_plain_text(capsys):

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"captioner {__version__}\n"
    assert re.fullmatch(r"\d+\.\d+\.\d+", __version__)
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in {"": parser, **commands}.items():
        assert cli.main([name, "--help"] if name else ["--help"]) == 0
        text = capsys.readouterr().out
        assert "`" not in text, (name, text)  # no reStructuredText markup
        flat = " ".join(text.split())
        for action in sub._actions:
            if action.option_strings and action.default not in (None, False, argparse.SUPPRESS):
                shown = f"(default: {action.default})"
                assert shown in flat, (name, action.option_strings, shown)
    caption = " ".join(commands["caption"].format_help().split())
    # a decoding option's default is the model's own, and a zero is shown as one
    assert (
        "--length-penalty LENGTH_PENALTY GNMT alpha: captions compared on score / ((5 + length) / 6) ** alpha "
        "(default: the model's; 0.0 for an" in caption
    )
    for group in ("decoding (every method):", "beam search (--method beam or diverse):",
                  "diverse beam search (--method diverse):", "sampling (--method sample):"):  # fmt: skip
        assert group in caption
    assert "--max-len MAX_LEN maximum words per caption (default: the model's; 20 for an older model file)" in caption


def test_help_does_not_import_torch():
    script = (
        "import sys\n"
        "from captioner.cli import main\n"
        "codes = [main(['--help']), main(['caption', '--help']), main(['evaluate', '--help'])]\n"
        "print(codes, 'torch' in sys.modules, file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.stderr == "[0, 0, 0] False\n"
    assert "a backslash, tab, newline or carriage return" in proc.stdout  # the TSV escapes, documented


def test_a_misspelt_option_gets_its_nearest_match_and_an_unknown_one_is_named(capsys):
    assert cli.main(["caption", "a.jpg", "--model", "m.pt", "--beamsize", "5"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("usage: captioner caption")  # the command's usage, not the top level's
    assert err[-1] == "captioner caption: error: unrecognized argument --beamsize; did you mean --beam-size?"
    assert cli.main(["attend", "a.jpg", "--model", "m.pt", "--out", "g", "--max_len=3"]) == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == "captioner attend: error: unrecognized argument --max_len=3; did you mean --max-len?"
    assert cli.main(["caption", "a.jpg", "--model", "m.pt", "--zzz"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == "captioner caption: error: unrecognized argument --zzz"
