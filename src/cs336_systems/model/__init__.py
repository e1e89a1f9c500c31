"""The Transformer LM of assignment 1, its optimizer and loss."""

from cs336_systems.model.config import BATCH_SIZE, PRESETS, TABLE1_SIZES, ModelConfig, get_preset
from cs336_systems.model.loss import cross_entropy
from cs336_systems.model.optim import AdamW
from cs336_systems.model.transformer import TransformerLM, annotated_forward, count_parameters

__all__ = [
    "BATCH_SIZE",
    "PRESETS",
    "TABLE1_SIZES",
    "AdamW",
    "ModelConfig",
    "TransformerLM",
    "annotated_forward",
    "count_parameters",
    "cross_entropy",
    "get_preset",
]
