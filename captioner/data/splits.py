"""The dataset splits every reader, data module, metric name and command line knows."""

SPLITS = ("train", "val", "test")
