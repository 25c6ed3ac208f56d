"""captioner: Show, Attend and Tell image captioning."""

__version__ = "0.1.0"
