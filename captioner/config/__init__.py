"""Every setting of the model, its training and its data: one typed dataclass per concern.

Each field carries its default, its comment and its valid range (checked in ``__post_init__``);
choices are ``StrEnum``s. One module per concern: ``network`` (what a bundle stores), ``decoding``, ``model``
(the ``model`` group: the network and its training), ``data`` (the ``data`` group), ``train`` (the whole
config); ``settings`` is what they are built with (``from_dict``, which names the key of a bad value:
``model.decoder.dropout=1.5 must be ...``, and ``to_dict``). The Hydra configs in ``conf/`` use these
classes as their schemas (``SCHEMAS``), so a misspelt key fails when the config is composed.

The network's defaults are those of the built-in demo (``python train.py``); its recipe (SCST, epochs) is
``conf/experiment/demo.yaml``, and ``conf/experiment/coco_*`` set the paper's.
"""

from captioner.config.data import (
    MAX_AUTO_WORKERS,
    MAX_IMAGE_SIZE,
    MIN_IMAGE_SIZE,
    UNKNOWN_WORDS_WARNING,
    CaptionsSpec,
    DataConfig,
    FeatureDtype,
    ImageDecoding,
    SceneKind,
    ShapesSpec,
)
from captioner.config.decoding import (
    CAPTIONING_BATCH_SIZE,
    CAPTIONING_METHOD,
    CAPTIONING_WORKERS,
    MAX_LEN,
    MAX_VOCAB_SIZE,
    MAX_WORDS,
    METHOD_SETTINGS,
    DecodeMethod,
    DecodingConfig,
    EnsembleMean,
    captioning_settings,
)
from captioner.config.model import (
    PER_WORD_GRAPHS,
    Compile,
    LossConfig,
    ModelConfig,
    NonFinite,
    Objective,
    OptimizerConfig,
    ReinforceReward,
    Schedule,
    SchedulerConfig,
    ScstBaseline,
    ScstConfig,
    TrainingEncoderConfig,
)
from captioner.config.network import (
    ARCHITECTURE,
    MAX_MODEL_BYTES,
    Attention,
    DecoderConfig,
    EncoderConfig,
    Gate,
    HardEstimator,
    HardInference,
    NetConfig,
    Positional,
    Scorer,
    SelfAttentionConfig,
)
from captioner.config.settings import Settings, from_dict, to_dict
from captioner.config.train import SCHEMAS, InitVocab, SamplesConfig, TrainConfig

__all__ = [
    "ARCHITECTURE",
    "CAPTIONING_BATCH_SIZE",
    "CAPTIONING_METHOD",
    "CAPTIONING_WORKERS",
    "MAX_AUTO_WORKERS",
    "MAX_IMAGE_SIZE",
    "MAX_VOCAB_SIZE",
    "MAX_LEN",
    "MAX_MODEL_BYTES",
    "MAX_WORDS",
    "METHOD_SETTINGS",
    "MIN_IMAGE_SIZE",
    "PER_WORD_GRAPHS",
    "SCHEMAS",
    "UNKNOWN_WORDS_WARNING",
    "Attention",
    "CaptionsSpec",
    "Compile",
    "DataConfig",
    "DecodeMethod",
    "EnsembleMean",
    "DecoderConfig",
    "DecodingConfig",
    "EncoderConfig",
    "FeatureDtype",
    "Gate",
    "HardEstimator",
    "HardInference",
    "ImageDecoding",
    "InitVocab",
    "LossConfig",
    "ModelConfig",
    "NetConfig",
    "NonFinite",
    "Objective",
    "OptimizerConfig",
    "Positional",
    "ReinforceReward",
    "Schedule",
    "SchedulerConfig",
    "Scorer",
    "ScstBaseline",
    "ScstConfig",
    "SelfAttentionConfig",
    "SamplesConfig",
    "SceneKind",
    "ShapesSpec",
    "Settings",
    "TrainConfig",
    "TrainingEncoderConfig",
    "captioning_settings",
    "from_dict",
    "to_dict",
]
