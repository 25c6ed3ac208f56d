"""The names of the files a training run keeps in its folder.

``train.py`` and ``captioner.training`` write them; ``captioner.bundle.load_trained`` (a run folder means its
bundle) and ``captioner.training.start`` (a run folder means its last checkpoint) find them by these names.
``conf/callbacks/default.yaml`` names the checkpoint folder and file for Lightning; a test holds it to these.
"""

from __future__ import annotations

BUNDLE_NAME = "bundle.pt"  # the inference bundle exported when training ends
CHECKPOINT_DIR = "checkpoints"  # the Lightning checkpoints (callbacks.model_checkpoint.dirpath)
LAST_CHECKPOINT = "last.ckpt"  # in CHECKPOINT_DIR: what ckpt_path=<run folder> resumes
VOCAB_FILE = "vocab.json"  # the vocabulary of the checkpoint a run starts from (data.vocab_file)
CONFIG_FILE = "config.yaml"  # the composed config, resolved
FAILED_FILE = "FAILED"  # written by a run that failed: its one-line error
STOPPED_FILE = "STOPPED"  # written by a run stopped by a signal (Ctrl-C, SIGTERM): how to resume it, in one line
METRICS_FILE = "metrics.json"  # the final validation (and test) metrics; also what `captioner evaluate` writes
VAL_CAPTIONS_FILE = "val_captions.json"  # the selected checkpoint's validation captions, COCO results format
SAMPLES_DIR = "samples"  # a few validation images captioned and attended after every validation (epoch_NNN.png)
CURVES_FILE = "curves.png"  # training loss, BLEU-4, CIDEr-D and attention correctness per epoch, drawn at the end
