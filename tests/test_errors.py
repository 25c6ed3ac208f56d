"""User-facing errors: their types, and the one-line messages made from other exceptions."""

from __future__ import annotations

import pytest
import torchvision

from captioner.errors import BundleError, CaptionerError, ConfigError, DataError, check_choice, check_range, first_line
from conftest import make_encoder


def test_a_config_error_is_caught_as_a_value_error_like_torchvisions_own() -> None:
    with pytest.raises(ValueError, match="Unknown model"):
        torchvision.models.get_model("resnet1001")
    with pytest.raises(ValueError, match="encoder.name='resnet1001' is not a torchvision classification model"):
        make_encoder("resnet1001")
    with pytest.raises(ValueError, match=r"beam_size=0 must be >= 1"):
        check_range("beam_size", 0, 1, kind=int)
    with pytest.raises(ValueError, match="method='topk' is not valid; choose one of: greedy, beam"):
        check_choice("method", "topk", ("greedy", "beam"))
    assert issubclass(ConfigError, CaptionerError)  # the entry points still print it as one line
    assert not issubclass(DataError, ValueError) and not issubclass(BundleError, ValueError)


def test_first_line_is_the_first_line_of_the_message_or_the_type() -> None:
    exc = RuntimeError("  CUDA out of memory. Tried to allocate 2 GiB.\nSee the documentation\n")
    assert first_line(exc) == "CUDA out of memory. Tried to allocate 2 GiB."
    assert first_line(exc, with_type=True) == "RuntimeError: CUDA out of memory. Tried to allocate 2 GiB."
    assert first_line(exc, first_sentence=True) == "CUDA out of memory"
    assert first_line(exc, first_sentence=True, with_type=True) == "RuntimeError: CUDA out of memory"
    assert first_line(EOFError()) == first_line(EOFError(" \n"), with_type=True) == "EOFError"
    assert first_line(ValueError("version 3.2 is too new")) == "version 3.2 is too new"  # a dot, no sentence end
    assert first_line(ValueError("version 3.2 is too new"), first_sentence=True) == "version 3.2 is too new"
