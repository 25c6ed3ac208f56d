"""The encoder's ImageNet weights are downloaded as torchvision does (its hash check, its progress bar) from a real
HTTP server on 127.0.0.1 serving a small squeezenet1_1 state dict, the weights' URL pointed at it: a missing file
lands in $TORCH_HOME and loads; a download cut short, altered, refused or not found is one line naming the URL,
the cache path and the remedy, and leaves nothing in the cache; processes that share the cache download it once;
``model.encoder.download=false`` never downloads, and building an encoder never does."""

from __future__ import annotations

import hashlib
import http.server
import io
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torchvision.models import SqueezeNet1_1_Weights, get_model

from captioner.config import EncoderConfig, to_dict
from captioner.data.vocab import Vocabulary
from captioner.errors import ConfigError, DownloadError
from captioner.model import pretrained
from captioner.model.encoder import Encoder
from captioner.model.pretrained import download, fetch, weight_file
from captioner.training.module import CaptionerModule
from captioner.training.preflight import GUIDE, PreflightError, check
from captioner.training.validate import validate_config
from conftest import ROOT, compose_plain, error_line, subprocess_env

WEIGHTS = SqueezeNet1_1_Weights.IMAGENET1K_V1  # DEFAULT too: 1.2 M parameters, served as float16 (2.5 MB)
ENCODER = ["model.encoder.name=squeezenet1_1", "model.encoder.weights=DEFAULT", "model.encoder.stage=null"]
ALTERED = "the file received does not match the SHA-256 prefix {prefix} in its name (cut short or altered)"


class WeightsServer(http.server.ThreadingHTTPServer):
    """Serves ``files`` (URL path -> bytes); a path in ``truncated`` gets its full Content-Length and only half its
    bytes before the connection closes; ``delay`` seconds before each answer. ``requests``: the GETs, in order."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files: dict[str, bytes] = {}
        self.truncated: set[str] = set()
        self.delay = 0.0
        self.requests: list[str] = []

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/{name}"


class _Handler(http.server.BaseHTTPRequestHandler):
    server: WeightsServer

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.server.requests.append(self.path)
        time.sleep(self.server.delay)
        data = self.server.files.get(self.path)
        if data is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2] if self.path in self.server.truncated else data)
        self.close_connection = True

    def log_message(self, *args: object) -> None:
        """Quiet."""


@pytest.fixture(scope="module")
def served() -> tuple[bytes, dict[str, torch.Tensor]]:
    """A squeezenet1_1 state dict of seeded random float16 values as torch.save writes it, and the dict."""
    torch.manual_seed(0)
    state = {key: torch.randn(value.shape).half() for key, value in get_model("squeezenet1_1").state_dict().items()}
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue(), state


@pytest.fixture
def server() -> Iterator[WeightsServer]:
    running = WeightsServer()
    thread = threading.Thread(target=running.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield running
    running.shutdown()
    running.server_close()
    thread.join()


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty TORCH_HOME: the checkpoints folder in it, which does not exist yet."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    return tmp_path / "torch" / "hub" / "checkpoints"


def _serve(server: WeightsServer, data: bytes, monkeypatch: pytest.MonkeyPatch, prefix: str | None = None,
           truncated: bool = False) -> str:  # fmt: skip
    """Serve ``data`` as squeezenet1_1's weights under a name with ``prefix`` (the first 8 hex digits of its
    SHA-256 unless given), the weights' URL pointed at it; returns the URL."""
    name = f"squeezenet1_1-{prefix or hashlib.sha256(data).hexdigest()[:8]}.pth"
    server.files[f"/{name}"] = data
    if truncated:
        server.truncated.add(f"/{name}")
    monkeypatch.setattr(WEIGHTS.value, "url", server.url(name))
    return server.url(name)


def _left(cache: Path) -> list[str]:
    """What the cache holds but the lock file that coordinates downloads (no weights, no .partial file)."""
    return sorted(p.name for p in cache.iterdir() if not p.name.endswith(".lock")) if cache.exists() else []


def _encoder() -> Encoder:
    return Encoder(EncoderConfig(name="squeezenet1_1", weights="DEFAULT", stage=None, trainable_stages=0))


def _module(tmp_path: Path, *overrides: str) -> CaptionerModule:
    """The training module of the config with squeezenet1_1's weights (and ``overrides``), as every process of a
    run builds it."""
    settings = validate_config(compose_plain([*ENCODER, *overrides], tmp_path))
    return CaptionerModule(Vocabulary(["a"]), settings.model)


def test_a_missing_file_is_downloaded_into_torch_home_checked_and_loaded(
    server: WeightsServer, served: tuple[bytes, dict], cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    data, state = served
    url = _serve(server, data, monkeypatch)
    encoder = _module(tmp_path).model.encoder
    path = cache / Path(url).name
    assert weight_file(WEIGHTS) == str(path) and path.read_bytes() == data and _left(cache) == [path.name]
    torch.testing.assert_close(encoder.stages[0].weight, state["features.0.weight"].float())  # the first conv
    torch.testing.assert_close(encoder.stages[-1].expand3x3.bias, state["features.12.expand3x3.bias"].float())
    out, err = capsys.readouterr()
    assert f'Downloading: "{url}" to {path}' in out and "100%" in out  # torch.hub's progress bar, on stdout
    assert err == ""
    _module(tmp_path)
    assert len(server.requests) == 1  # the file in the cache is read
    assert "download" not in to_dict(_module(tmp_path).net)["encoder"]  # how the file came is no bundle's business


@pytest.mark.parametrize(
    "case, reason",
    [
        ("truncated", ALTERED),
        ("wrong hash", ALTERED),
        ("not found", "the server answered HTTP 404 Not Found"),
        ("no server", "no connection: [Errno 111] Connection refused"),
        ("silent server", "the server sent nothing for 0.5 s"),
    ],
)
def test_a_failed_download_is_one_line_with_the_url_the_path_and_the_remedy_and_leaves_nothing(
    case: str, reason: str, server: WeightsServer, served: tuple[bytes, dict], cache: Path, monkeypatch
) -> None:
    data = served[0]
    prefix = "0badf00d" if case == "wrong hash" else hashlib.sha256(data).hexdigest()[:8]
    url = _serve(server, data, monkeypatch, prefix=prefix, truncated=case == "truncated")
    if case == "not found":
        server.files.clear()
    if case == "no server":
        with socket.socket() as closed:  # a port nothing listens on
            closed.bind(("127.0.0.1", 0))
            url = f"http://127.0.0.1:{closed.getsockname()[1]}/squeezenet1_1-{prefix}.pth"
        monkeypatch.setattr(WEIGHTS.value, "url", url)
    if case == "silent server":  # it answers after the download has given up
        monkeypatch.setattr(pretrained, "DOWNLOAD_TIMEOUT", 0.5)
        server.delay = 2.0
    path = cache / f"squeezenet1_1-{prefix}.pth"
    with pytest.raises(ConfigError) as info:
        fetch("squeezenet1_1", "DEFAULT")
    assert str(info.value) == (
        "encoder.weights='DEFAULT': the ImageNet weights of squeezenet1_1 are not on disk and the download failed: "
        f"{reason.format(prefix=prefix)}; download {url} and save it as {path} (TORCH_HOME moves that folder)"
    )
    assert _left(cache) == []  # no weights file, no .partial one
    assert len(server.requests) == (0 if case == "no server" else 1)
    with pytest.raises(ConfigError, match="not on disk; download"):
        _encoder()  # nothing to read, and building never downloads
    assert len(server.requests) == (0 if case == "no server" else 1)


def test_train_py_downloads_nothing_while_another_problem_stops_the_run_and_then_reports_a_failed_one(
    server: WeightsServer, served: tuple[bytes, dict], cache: Path, tmp_path: Path, monkeypatch, capsys
) -> None:
    data = served[0]
    url = _serve(server, data, monkeypatch, prefix="0badf00d")
    root = f"data.source.root={tmp_path}/s"
    with pytest.raises(PreflightError) as info:
        check(compose_plain([*ENCODER, root, f"data.vocab_file={tmp_path}/v.json"], tmp_path))
    assert [problem.what.split("=")[0] for problem in info.value.problems] == ["data.vocab_file"]
    assert server.requests == []  # a run that cannot start downloads nothing
    with pytest.raises(PreflightError) as info:
        check(compose_plain([*ENCODER, root], tmp_path))
    path = cache / "squeezenet1_1-0badf00d.pth"
    assert str(info.value) == (
        "model.encoder.weights='DEFAULT': the ImageNet weights of squeezenet1_1 are not on disk and the download "
        "failed: the file received does not match the SHA-256 prefix 0badf00d in its name (cut short or altered); "
        f"download {url} and save it as {path} (TORCH_HOME moves that folder) ({GUIDE}#encoder-weights)"
    )
    assert _left(cache) == [] and len(server.requests) == 1
    capsys.readouterr()
    _serve(server, data, monkeypatch)  # the right file
    check(compose_plain([*ENCODER, root], tmp_path))
    assert _left(cache) == [Path(WEIGHTS.url).name] and "Downloading:" in capsys.readouterr().out


def test_with_download_false_a_missing_file_is_todays_remedy_and_nothing_is_fetched(
    server: WeightsServer, served: tuple[bytes, dict], cache: Path, tmp_path: Path, monkeypatch
) -> None:
    url = _serve(server, served[0], monkeypatch)
    path = cache / Path(url).name
    with pytest.raises(PreflightError) as info:
        check(compose_plain([*ENCODER, "model.encoder.download=false", f"data.source.root={tmp_path}/s"], tmp_path))
    assert str(info.value) == (
        "model.encoder.weights='DEFAULT': the ImageNet weights of squeezenet1_1 are not on disk "
        f"(model.encoder.download=false); download {url} and save it as {path} (TORCH_HOME moves that folder) "
        f"({GUIDE}#encoder-weights)"
    )
    with pytest.raises(ConfigError, match=r"^encoder.weights='DEFAULT': the ImageNet weights of .* not on disk; downl"):
        _module(tmp_path, "model.encoder.download=false")  # another process of the run
    assert server.requests == [] and not cache.exists()


def test_processes_sharing_the_cache_download_it_once(
    server: WeightsServer, served: tuple[bytes, dict], cache: Path, monkeypatch
) -> None:
    """As a DDP run's ranks of one machine do when they start together: the lock file makes the others wait."""
    url = _serve(server, served[0], monkeypatch)
    server.delay = 0.5  # both ask while the first download is under way
    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(download(WEIGHTS))) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert paths == [str(cache / Path(url).name)] * 2 and len(server.requests) == 1


def test_a_download_error_names_what_failed(server: WeightsServer, cache: Path, monkeypatch) -> None:
    monkeypatch.setattr(WEIGHTS.value, "url", server.url("squeezenet1_1-12345678.pth"))
    cache.parent.mkdir(parents=True)
    cache.write_text("a file where the folder goes")
    with pytest.raises(DownloadError, match=r"^FileExistsError: \[Errno 17\] File exists"):
        download(WEIGHTS)
    assert server.requests == []


# ``python -c SCRIPT ARGS``: train.py with ARGS, squeezenet1_1's weights served from URL.
POINTED = """import runpy, sys
from torchvision.models import SqueezeNet1_1_Weights
SqueezeNet1_1_Weights.IMAGENET1K_V1.value.url = sys.argv.pop(1)
sys.argv[0] = {train!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
def test_train_py_stops_on_a_failed_download_with_one_line_and_no_run_folder(
    server: WeightsServer, served: tuple[bytes, dict], tmp_path: Path
) -> None:
    data = served[0]
    name = f"squeezenet1_1-{hashlib.sha256(data).hexdigest()[:8]}.pth"
    server.files[f"/{name}"] = data
    server.truncated.add(f"/{name}")
    logs, torch_home = tmp_path / "logs", tmp_path / "torch"
    args = [*ENCODER, f"paths.log_dir={logs}", f"data.source.root={tmp_path}/s", "trainer.max_epochs=1"]
    script = POINTED.format(train=str(ROOT / "train.py"))
    proc = subprocess.run([sys.executable, "-c", script, server.url(name), *args], cwd=tmp_path,
                          env={**subprocess_env(), "TORCH_HOME": str(torch_home)}, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    line = error_line(proc)
    assert line.startswith("error: model.encoder.weights='DEFAULT': the ImageNet weights of squeezenet1_1 are not on")
    assert f"download {server.url(name)} and save it as {torch_home / 'hub' / 'checkpoints' / name}" in line
    assert _left(torch_home / "hub" / "checkpoints") == [] and not logs.exists() and len(server.requests) == 1
