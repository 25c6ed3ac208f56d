"""The arguments of every ``captioner`` sub-command. Imports no torch: ``captioner --help`` answers at once."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Sequence

from captioner import __version__
from captioner.config import (
    CAPTIONING_BATCH_SIZE,
    CAPTIONING_METHOD,
    CAPTIONING_WORKERS,
    DecodeMethod,
    DecodingConfig,
    EnsembleMean,
    HardInference,
    ImageDecoding,
    SceneKind,
    ShapesSpec,
)
from captioner.data.splits import SPLITS

DESCRIPTION = """caption images, draw attention overlays, evaluate a model on a dataset, prepare datasets.

    captioner caption IMAGE_OR_FOLDER_OR_GLOB... --model bundle.pt [--beam-size 3] [--json]
    find photos -name '*.jpg' | captioner caption - --model bundle.pt
    find photos -name '*.jpg' -print0 | captioner caption -0 - --model bundle.pt
    captioner caption --image-info image_info_test2014.json --images test2014/ --out DIR --model bundle.pt
    captioner attend IMAGE... --model bundle.pt --out overlay.png | --out DIR
    captioner evaluate --model bundle.pt|last.ckpt --shapes data/shapes --split test --out DIR
    captioner evaluate --model RUN --captions photos/captions.csv --split test --out DIR
    captioner splits coco --captions-dir data/coco/annotations
    captioner shapes --out data/shapes_small --train 300 --val 50 --test 50

--model takes a training run's folder, the bundle.pt that training exports there, or one of its Lightning
checkpoints; --model a --model b ... decodes with their ensemble (the mean of the models' log-probabilities at
every word, or with --ensemble-mean prob of their probabilities; one vocabulary). Images are decoded in worker
processes and captioned a batch at a time; a progress bar shows on stderr for many. A bad input file gets one
line on stderr naming it and the reason; the other images are still captioned and the exit status is 1. A bad
argument, model file or dataset gets one line and exit status 2. No traceback. caption and attend end with a
summary line on stderr (images captioned, failed, skipped, images/s); see captioner caption --help for the output
formats. A model decodes as its training run decoded its final scores (beam search, as long as its training
captions, ...: the scores that run printed are the scores captioner evaluate gives); each decoding option given
replaces one of those."""
PROGRESS_MIN_IMAGES = 64  # a progress bar on stderr from this many images
STDIN = "-"  # among the inputs: read image paths from standard input, one per line
NUL_HELP = "(or -0) - reads NUL-separated paths (find -print0) instead of one per line"
DEFAULT_NAME = "captioner"  # the algorithm name in a results file for the COCO evaluation server

CAPTION_OUTPUT = """output:
  stdout holds one line per captioned image, PATH<TAB>CAPTION; with --json one JSON object per line,
  {"path", "caption", "score", "tokens"} for a captioned image and {"path", "error"} for each input that
  failed. With --n-best N a captioned image's object also holds "n_best", its N best captions best first,
  each {"caption", "score", "tokens"}, and without --json the image has N lines, best first. Every failure
  is also one line on stderr, "error: PATH: REASON". In the tab-separated lines
  a backslash, tab, newline or carriage return inside a field is written as \\\\, \\t, \\n or \\r,
  so every line has exactly two fields.
  A folder is searched recursively for image files: files named like an image (.jpg, .png, ...) and files
  without a suffix that hold an image; other files are skipped and counted in the summary, hidden files and
  folders (.thumbs/, ._photo.jpg) are left out, and so are the files of a captioner attend gallery (those
  its .captioner-gallery lists; a line on stderr counts them). A file named twice (directly, by its folder,
  by a glob) is captioned once. Links are followed: to a file, and to a folder outside the one searched (once).
  stderr ends with one summary line: images captioned, failed, skipped, images/s.
  Exit status: 0 every input captioned, 1 some input failed or no image was given (an empty folder, empty
  standard input), 2 a bad argument or model file."""

# The option of each ShapesSpec field for ``captioner shapes`` (its dest is the field's name) and what it sets.
SHAPES_OPTIONS = {
    "n_train": ("--train", "training images"),
    "n_val": ("--val", "validation images"),
    "n_test": ("--test", "test images"),
    "image_size": ("--image-size", "simple scenes only: the square images' side in pixels"),
    "seed": ("--seed", "the same seed, the same images"),
    "scenes": (
        "--scenes",
        "simple: 1-3 shapes in a 3x3 grid (the demo's); cluttered: 2-4 shapes of six kinds placed freely among "
        "clutter, captions with counts and relations (data=scenes)",
    ),
    "width": ("--width", "cluttered scenes only: image width in pixels"),
    "height": ("--height", "cluttered scenes only: image height in pixels"),
}

SPLITS_EPILOG = """coco: val and test are Karpathy's 5,000 val2014 images each (their ids ship with captioner), train is
  all of train2014 plus the rest of val2014 (restval), 113,287 images; sentences are tokenised as Karpathy's
  (lower case, punctuation dropped). The file is what data=coco_karpathy reads (see docs/datasets.md)."""


# The decoding options in their --help groups: flag -> (type, help, what a model file that does not keep its decoding
# settings decodes with). Their bounds are DecodingConfig's; one that a method does not read is refused with it.
DECODING_OPTIONS = {
    "decoding (every method)": {
        "--method": (None, "decoding method", CAPTIONING_METHOD.value),
        "--max-len": (int, "maximum words per caption", DecodingConfig.max_len),
        "--min-len": (int, "no <end> before this many words (0 and 1 alike: never empty)", DecodingConfig.min_len),
        "--no-repeat-ngram-size": (
            int,
            "no n-gram of this many words twice in a caption (0: off)",
            DecodingConfig.no_repeat_ngram_size,
        ),
    },
    "beam search (--method beam or diverse)": {
        "--beam-size": (int, "captions kept per image (diverse: all groups' together)", DecodingConfig.beam_size),
        "--length-penalty": (float, "GNMT alpha: captions compared on score / ((5 + length) / 6) ** alpha",
                             DecodingConfig.length_penalty),
        "--n-best": (int, "return the N best captions of each image with their scores (N <= --beam-size)",
                     DecodingConfig.n_best),
    },
    "diverse beam search (--method diverse)": {
        "--groups": (int, "groups of --beam-size / G beams; each group's words are penalised where earlier groups "
                     "chose them at the same word", DecodingConfig.groups),
        "--diversity": (float, "the log-prob taken off a word for each earlier group's beam that chose it",
                        DecodingConfig.diversity),
    },
    "sampling (--method sample)": {
        "--temperature": (float, "softmax(logits / temperature)", DecodingConfig.temperature),
        "--top-k": (int, "draw among the K most likely words only (0: all)", DecodingConfig.top_k),
        "--top-p": (float, "nucleus: draw among the fewest most likely words that hold P of the probability (1: all)",
                    DecodingConfig.top_p),
        "--seed": (int, "the same seed, the same captions", "none"),
    },
}  # fmt: skip


class _Given(argparse.Action):
    """Stores the option's value and records that it was given (its name in ``args.given``): a decoding option
    replaces the model's own setting only when given, and one that one decoding method reads
    (``METHOD_SETTINGS``) is refused with another only then."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        namespace.given = {*namespace.given, self.dest}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The parsed command line. ``-0`` is read as ``--null``: argparse, given an option named like a negative
    number, would take every negative number (``--workers -1``) for an option too."""
    args = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    commands = parser._subparsers._group_actions[0].choices  # name -> the command's parser
    takes_value = {
        option
        for sub in commands.values()
        for action in sub._actions
        if action.nargs != 0
        for option in action.option_strings
    }
    args = ["--null" if a == "-0" and (i == 0 or args[i - 1] not in takes_value) else a for i, a in enumerate(args)]
    parsed, unknown = parser.parse_known_args(args)
    if unknown:
        _unknown(commands[parsed.command], unknown)
    return parsed


def _unknown(command: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit as argparse does (usage and one error line, status 2) for arguments ``command`` does not take, the
    first misspelt option with its nearest match: ``--beamsize``, did you mean ``--beam-size``?"""
    options = [option for action in command._actions for option in action.option_strings]
    for item in unknown:
        name = item.partition("=")[0]
        if name.startswith("--"):
            near = difflib.get_close_matches(name, options, n=1, cutoff=0.6)
            command.error(f"unrecognized argument {item}" + (f"; did you mean {near[0]}?" if near else ""))
    command.error(f"unrecognized arguments: {' '.join(unknown)}")


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Shows each option's default after its help (not for required options, flags, or no default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            action.required
            or not action.option_strings
            or default is None
            or default is False
            or default == argparse.SUPPRESS
        ):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _common(sub: argparse.ArgumentParser, n_best: bool = False) -> None:
    """The model, decoding, batching and device options every command takes (``n_best``: ``--n-best`` too), the
    decoding options in a group per method."""
    sub.add_argument(
        "--model",
        required=True,
        action="append",
        help="a training run's folder (its bundle.pt), a bundle.pt, or a training checkpoint; given several times, "
        "their ensemble: the mean of the models' log-probabilities at every word, each model reading the image at "
        "its own input size; one vocabulary; the first model's decoding settings",
    )
    sub.add_argument(
        "--ensemble-mean",
        choices=[str(mean) for mean in EnsembleMean],
        default=str(EnsembleMean.log),
        help="how an ensemble averages its models' word distributions: log, the normalised mean of their "
        "log-probabilities; prob, of their probabilities (default: %(default)s)",
    )
    sub.set_defaults(given=set())
    for title, options in DECODING_OPTIONS.items():
        group = sub.add_argument_group(title)
        for name, (kind, text, fallback) in options.items():
            if name == "--n-best" and not n_best:
                continue
            group.add_argument(
                name,
                type=kind,
                choices=list(DecodeMethod) if name == "--method" else None,
                action=_Given,
                help=f"{text} (default: the model's; {fallback} for an older model file)",
            )
    sub.add_argument(
        "--batch-size", type=int, default=CAPTIONING_BATCH_SIZE, help="images encoded and decoded together"
    )
    sub.add_argument(
        "--workers", type=int, default=CAPTIONING_WORKERS, help="image-decoding processes; 0 decodes in this one"
    )
    sub.add_argument(
        "--decode",
        choices=list(ImageDecoding),
        default=ImageDecoding.auto,
        help="where images are decoded: loader (Pillow, in the --workers processes), device (the workers read the "
        "files, the model's device decodes each batch's JPEGs: nvjpeg on CUDA; other images by Pillow), or auto: "
        "device on a CUDA device, loader otherwise",
    )
    sub.add_argument(
        "--hard-inference",
        choices=list(HardInference),
        help="hard attention models: read the most likely location (argmax) or the expected context "
        "(expectation) at each word (default: the model's own, model.decoder.hard_inference)",
    )
    sub.add_argument(
        "--max-pixels",
        type=int,
        metavar="N",
        help="the most pixels an image file may decode to, a guard against decompression bombs: raise it for a "
        "very large photo you trust; a JPEG over it is read at a reduced scale where that keeps the model's "
        "input size (default: Pillow's limit, PIL.Image.MAX_IMAGE_PIXELS)",
    )
    sub.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    sub.add_argument(
        "--no-progress",
        action="store_true",
        help=f"no progress bar on stderr (shown from {PROGRESS_MIN_IMAGES} images when stderr is a terminal)",
    )


def _server(sub: argparse.ArgumentParser, images: str) -> None:
    """The options of a COCO image list whose captions go to the evaluation server."""
    sub.add_argument(
        "--image-info",
        metavar="FILE",
        help="COCO image list (image_info_test2014.json, or a captions file such as "
        "captions_val2014.json): caption its images and write the evaluation server's "
        "results file captions_<split>_<name>_results.json into --out",
    )
    sub.add_argument("--images", dest="image_dir", metavar="DIR", help=images)
    sub.add_argument(
        "--name", default=DEFAULT_NAME, help="algorithm name in the results file name (letters, digits, hyphens)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of every sub-command."""
    parser = argparse.ArgumentParser(prog="captioner", description=DESCRIPTION, formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, text: str, epilog: str | None = None) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=text, description=text, epilog=epilog, formatter_class=_HelpFormatter)

    inputs_help = "image files, folders (searched recursively) and globs; - reads paths from standard input"
    caption = command(
        "caption", "caption image files, folders and globs, or the images of a COCO image list", CAPTION_OUTPUT
    )
    caption.add_argument("inputs", nargs="*", metavar="IMAGE", help=inputs_help)
    _common(caption, n_best=True)
    caption.add_argument("--null", dest="nul", action="store_true", help=NUL_HELP)
    caption.add_argument(
        "--json",
        action="store_true",
        help="JSON lines: path, caption, score, tokens (and n_best with --n-best; or error)",
    )
    _server(caption, "folder of the --image-info images")
    caption.add_argument("--out", metavar="DIR", help="folder for the --image-info results file")
    caption.add_argument(
        "--force", action="store_true", help="overwrite a results file captioner wrote (never one of yours)"
    )

    attend = command(
        "attend",
        "draw the attention map of every generated word",
        "an ensemble (--model given several times) draws the mean of its models' maps, on the first model's\n"
        "grid (a map on another grid resampled onto it)",
    )
    attend.add_argument("inputs", nargs="+", metavar="IMAGE", help=inputs_help)
    _common(attend)
    attend.add_argument("--null", dest="nul", action="store_true", help=NUL_HELP)
    attend.add_argument(
        "--out",
        required=True,
        help="FILE.png for one image, or a folder: a PNG per image, and index.html to step through each image's "
        "words (the folder holds all it shows: it can be moved)",
    )
    attend.add_argument(
        "--force",
        action="store_true",
        help="replace an earlier gallery's files, or a NAME.png captioner wrote (never one of yours)",
    )

    evaluate = command("evaluate", "BLEU and coco-caption metrics on a dataset split")
    _common(evaluate)
    evaluate.add_argument(
        "--split",
        choices=SPLITS,
        default="test",
        help="split of --shapes, --karpathy and --captions (and the name of the --coco-captions one)",
    )
    evaluate.add_argument("--shapes", help="root of the built-in dataset (python train.py generates data/shapes)")
    evaluate.add_argument("--karpathy", help="Karpathy split file (dataset_coco.json, dataset_flickr8k.json, ...)")
    evaluate.add_argument("--coco-captions", help="COCO captions file (captions_val2014.json, ...)")
    evaluate.add_argument(
        "--instances", help="COCO instances file of --coco-captions (boxes for attention correctness)"
    )
    evaluate.add_argument(
        "--captions",
        metavar="FILE",
        help="your own captions file (CSV, TSV or JSON Lines: what data=captions trained on), split as the --model "
        "run split it (the captions_split.json in its folder, or --split-file), with that run's image ids",
    )
    evaluate.add_argument(
        "--split-file",
        metavar="FILE",
        help="--captions: the captions_split.json a run wrote (default: the one in --model's run folder)",
    )
    _server(
        evaluate,
        "image root (--karpathy), folder (--coco-captions, --image-info), or the folder --captions' paths are "
        "relative to (default: the one the run read, else the file's own)",
    )
    evaluate.add_argument("--out", required=True, help="folder for results.json, metrics.json and per_image.json")
    evaluate.add_argument("--no-coco", action="store_true", help="skip the Java coco-caption suite")
    evaluate.add_argument(
        "--force", action="store_true", help="overwrite the files of an earlier evaluate in --out (never one of yours)"
    )
    shapes = command("shapes", "generate the built-in shapes dataset, of a chosen size, into a chosen folder")
    shapes.add_argument("--out", required=True, metavar="DIR", help="the dataset's folder (new, or empty)")
    for name, (flag, what) in SHAPES_OPTIONS.items():
        default = getattr(ShapesSpec, name)
        kind = {"choices": list(SceneKind)} if isinstance(default, SceneKind) else {"type": int, "metavar": "N"}
        shapes.add_argument(flag, dest=name, help=f"{what} (default: {default})", **kind)
    splits = command(
        "splits",
        "write Karpathy's split file of COCO (from the official COCO 2014 caption files) or Flickr8k (from its "
        "official split lists)",
        SPLITS_EPILOG,
    )
    splits.add_argument("dataset", choices=("coco", "flickr8k"), help="the dataset")
    splits.add_argument(
        "--captions-dir",
        required=True,
        metavar="DIR",
        help="coco: the folder of captions_train2014.json and captions_val2014.json; flickr8k: the folder of "
        "Flickr8k.token.txt and Flickr_8k.{train,dev,test}Images.txt",
    )
    splits.add_argument("--out", help="the split file to write (default: data/karpathy/dataset_<dataset>.json)")
    splits.add_argument(
        "--partial", action="store_true", help="coco: write the split of the listed images present (a COCO subset)"
    )
    splits.add_argument(
        "--force", action="store_true", help="overwrite a split file captioner wrote (never one of yours)"
    )
    return parser
