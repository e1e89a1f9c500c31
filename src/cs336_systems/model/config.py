"""Model configuration and the named presets of handout Table 1."""

from __future__ import annotations

from dataclasses import dataclass, replace

from cs336_systems.model.checkpointing import parse_checkpoint


@dataclass(frozen=True)
class ModelConfig:
    d_model: int
    d_ff: int
    num_layers: int
    num_heads: int
    vocab_size: int = 10_000
    context_length: int = 1024  # longest sequence the RoPE tables cover
    rope_theta: float = 10_000.0
    attention: str = "pytorch"  # a name from cs336_systems.attention.attention_names()
    name: str = "custom"
    checkpoint: str = (
        "none"  # activation checkpointing: "none", "every:K" or "nested" (model/checkpointing.py)
    )
    fused_loss: bool = False  # forward(ids, targets) through the fused LM-head + cross-entropy kernel

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}")
        if self.d_head % 2:
            raise ValueError(f"RoPE needs an even head dimension, got {self.d_head}")
        parse_checkpoint(self.checkpoint)  # raises on a policy outside the grammar

    @property
    def d_head(self) -> int:
        return self.d_model // self.num_heads

    def with_(self, **changes: object) -> ModelConfig:
        return replace(self, **changes)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(d_model=64, d_ff=256, num_layers=2, num_heads=4, context_length=256, name="tiny"),
    "small": ModelConfig(d_model=768, d_ff=3072, num_layers=12, num_heads=12, name="small"),
    "medium": ModelConfig(d_model=1024, d_ff=4096, num_layers=24, num_heads=16, name="medium"),
    "large": ModelConfig(d_model=1280, d_ff=5120, num_layers=36, num_heads=20, name="large"),
    "xl": ModelConfig(d_model=1600, d_ff=6400, num_layers=48, num_heads=25, name="xl"),
    "2.7B": ModelConfig(d_model=2560, d_ff=10240, num_layers=32, num_heads=32, name="2.7B"),
}

TABLE1_SIZES = ("small", "medium", "large", "xl", "2.7B")
BATCH_SIZE = 4  # the handout's reference batch


def get_preset(name: str, **changes: object) -> ModelConfig:
    try:
        config = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None
    return config.with_(**changes) if changes else config
