"""What TensorBoard shows of a run, seen as its user sees it: a real ``tensorboard`` server on 127.0.0.1 and a
headless Chromium rendering its pages (TensorBoard is a JavaScript app: its HTTP API lists the tags, not the
order its dashboards show them in)::

    python benchmarks/tensorboard_view.py outputs/train/runs/<run>                  # the groups TensorBoard opens on
    python benchmarks/tensorboard_view.py outputs/train/runs/<run> --shots shots/   # and a screenshot of each page

Prints the groups of tags of the Time Series page (the one TensorBoard opens on), in the order it shows them, with
their cards; then every sample image of the run's last validation with its size and the scale TensorBoard's
images tab shows it at (every picture 348 pixels wide: text drawn at 16 px reads at 16 times that scale). With
``--shots``, a screenshot of the Time Series, Scalars, Images and Text pages (1400 x 1000; the Polymer pages keep
their content in shadow DOM, so only a picture shows what they show). Needs ``chromium`` (or ``chromium-browser``,
``google-chrome``) on PATH and the ``tensorboard`` package.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

IMAGES_TAB_WIDTH = 348  # pixels: the width TensorBoard's images tab shows every picture at, whatever its size
PAGES = {"time_series": "", "scalars": "#scalars", "images": "#images", "text": "#text"}
WINDOW = (1400, 1000)  # the browser window's size, pixels
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
URL_LINE = re.compile(r"TensorBoard [\w.]+ at (http://127\.0\.0\.1:\d+/)")
GROUP = re.compile(r'class="group-title" title="([^"]*)"')  # a group of the Time Series page
CARD = re.compile(r'<tb-truncated-path [^>]*title="([^"]*)"')  # a card's tag on it


def browser() -> str | None:
    """The headless browser on PATH, if any."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


@contextmanager
def serve(logdir: Path, timeout: float = 120) -> Iterator[str]:
    """A ``tensorboard`` server of ``logdir`` on 127.0.0.1 (a free port), for the body: its URL."""
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir), "--host", "127.0.0.1", "--port", "0"]
    with tempfile.TemporaryFile("w+") as output:
        server = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, text=True)
        try:
            yield _served(server, output, time.monotonic() + timeout)
        finally:
            server.terminate()
            try:
                server.wait(timeout)
            except subprocess.TimeoutExpired:
                server.kill()


def _served(server: subprocess.Popen, output: IO[str], deadline: float) -> str:
    """The URL the ``server`` prints into ``output`` once it listens (RuntimeError: it stopped, or ``deadline``
    passed, first)."""
    while True:
        output.seek(0)
        printed = output.read()
        if found := URL_LINE.search(printed):
            return found[1]
        if server.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"tensorboard did not serve:\n{printed[-2000:]}")
        time.sleep(0.2)


def render(url: str, screenshot: Path | None = None, budget_ms: int = 15000) -> str:
    """The DOM of the page at ``url`` once its scripts ran (``budget_ms`` of virtual time), rendered in a
    ``WINDOW``-sized headless browser; with ``screenshot``, a PNG of the page there too."""
    base = [browser(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    base += [f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--virtual-time-budget={budget_ms}"]
    if screenshot is not None:
        subprocess.run([*base, f"--screenshot={screenshot}", url], capture_output=True, check=True, timeout=120)
    return subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, check=True, timeout=120).stdout


def time_series(dom: str) -> dict[str, list[str]]:
    """The groups of the Time Series page's ``dom`` in the order it shows them, each with its cards' tags."""
    groups: dict[str, list[str]] = {}
    for match in re.finditer(GROUP.pattern + "|" + CARD.pattern, dom):
        if match[1] is not None:
            groups[match[1]] = []
        elif groups:
            groups[next(reversed(groups))].append(match[2])
    return groups


def sample_images(logdir: Path) -> dict[str, tuple[int, int]]:
    """Each sample image's tag and its (width, height) at the last step it was logged."""
    from tensorboard.backend.event_processing.event_accumulator import IMAGES, EventAccumulator

    sizes = {}
    for folder in sorted({path.parent for path in logdir.rglob("events.out.tfevents.*")}):
        events = EventAccumulator(str(folder), size_guidance={IMAGES: 0}).Reload()
        for tag in events.Tags()[IMAGES]:
            last = events.Images(tag)[-1]
            sizes[tag] = (last.width, last.height)
    return sizes


def main(argv: list[str] | None = None) -> None:
    """Serve the run's TensorBoard folder, render its pages, print what they show."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a training run's folder (its tensorboard/), or a TensorBoard logdir")
    parser.add_argument("--shots", type=Path, help="a folder for a screenshot of each page")
    args = parser.parse_args(argv)
    logdir = args.run / "tensorboard" if (args.run / "tensorboard").is_dir() else args.run
    if browser() is None:
        sys.exit(f"no headless browser: install one of {', '.join(BROWSERS)} (apt-get install chromium)")
    if args.shots is not None:
        args.shots.mkdir(parents=True, exist_ok=True)
    with serve(logdir) as url:
        for page, anchor in PAGES.items():
            shot = None if args.shots is None else args.shots / f"{page}.png"
            dom = render(url + anchor, shot)
            if page == "time_series":
                print("Time Series, the page TensorBoard opens on: its groups in order, with their cards")
                for group, cards in time_series(dom).items():
                    print(f"  {group}: {', '.join(cards) or '(cards below the window)'}")
            if shot is not None:
                print(f"screenshot of the {page} page: {shot}")
    print(f"sample images (the images tab shows each {IMAGES_TAB_WIDTH} px wide):")
    for tag, (width, height) in sample_images(logdir).items():
        print(f"  {tag}: {width} x {height} px, shown at {IMAGES_TAB_WIDTH / width:.2f} of its size")


if __name__ == "__main__":
    main()
