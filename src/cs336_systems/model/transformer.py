"""The assignment-1 Transformer LM in one file: pre-norm blocks of RMSNorm, causal multi-head
self-attention with RoPE, and a SwiGLU feed-forward; final RMSNorm; untied LM head; no biases."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.attention import get_attention_fn
from cs336_systems.kernels.fused_cross_entropy import fused_linear_cross_entropy
from cs336_systems.model.checkpointing import run_blocks
from cs336_systems.model.config import ModelConfig
from cs336_systems.model.loss import cross_entropy
from cs336_systems.nvtx import annotate


def _trunc_normal_(weight: torch.Tensor, std: float) -> torch.Tensor:
    return nn.init.trunc_normal_(weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


class Linear(nn.Linear):
    """Bias-free linear layer with assignment 1's init: N(0, 2/(d_in+d_out)) truncated at 3 sigma."""

    def __init__(self, d_in: int, d_out: int, device=None, dtype=None):
        super().__init__(d_in, d_out, bias=False, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, math.sqrt(2.0 / (self.in_features + self.out_features)))


class LMHead(Linear):
    """The output projection. Given targets it returns the mean (or summed) cross-entropy through the
    fused chunked kernel instead of the logits, computed here from ``self.weight`` so that whatever
    wraps this module's forward (FSDP's all-gather hooks) sees the weight used."""

    def forward(
        self,
        x: torch.Tensor,
        targets: torch.Tensor | None = None,
        ignore_index: int = -100,
        reduction: str = "mean",
    ) -> torch.Tensor:
        if targets is None:
            return super().forward(x)
        if torch.is_autocast_enabled(x.device.type):
            # Autocast does not reach inside an autograd Function: take its precision explicitly. The
            # kernel casts the fp32 weight for its GEMMs and returns an fp32 gradient for it.
            x = x.to(torch.get_autocast_dtype(x.device.type))
        with torch.autocast(x.device.type, enabled=False):
            return fused_linear_cross_entropy(x, self.weight, targets, ignore_index, reduction)


class Embedding(nn.Embedding):
    def reset_parameters(self) -> None:
        _trunc_normal_(self.weight, 1.0)


class RMSNorm(nn.Module):
    def __init__(self, d_model: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d_model, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Mean of squares in fp32: in bf16/fp16 the sum of squares loses most of its bits.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(x.dtype)


class RotaryEmbedding(nn.Module):
    """RoPE on consecutive pairs (2k, 2k+1) of each head's features."""

    def __init__(self, d_head: int, max_seq_len: int, theta: float, device=None):
        super().__init__()
        inv_freq = theta ** (-torch.arange(0, d_head, 2, device=device, dtype=torch.float32) / d_head)
        angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
        # Tables are derived, not learned: non-persistent buffers move with .to() but stay out of state_dict.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        # The model always runs positions 0..seq-1: a slice is a view, a gather would be a kernel.
        if positions is None:
            seq = x.shape[-2]
            cos, sin = self.cos[:seq], self.sin[:seq]
        else:
            cos, sin = self.cos[positions], self.sin[positions]
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, device=None, dtype=None):
        super().__init__()
        self.num_heads = config.num_heads
        self.qkv_proj = Linear(config.d_model, 3 * config.d_model, device=device, dtype=dtype)
        self.output_proj = Linear(config.d_model, config.d_model, device=device, dtype=dtype)
        self.rope = rope
        self.attention = get_attention_fn(config.attention)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        qkv = self.qkv_proj(x).view(batch, seq, 3, self.num_heads, d_model // self.num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (batch, heads, seq, d_head)
        q, k = self.rope(q), self.rope(k)
        out = self.attention(q, k, v, True)
        return self.output_proj(out.transpose(1, 2).reshape(batch, seq, d_model))


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int, device=None, dtype=None):
        super().__init__()
        self.w1 = Linear(d_model, d_ff, device=device, dtype=dtype)
        self.w2 = Linear(d_ff, d_model, device=device, dtype=dtype)
        self.w3 = Linear(d_model, d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelConfig, rope: RotaryEmbedding, device=None, dtype=None):
        super().__init__()
        self.ln1 = RMSNorm(config.d_model, device=device, dtype=dtype)
        self.attn = CausalSelfAttention(config, rope, device=device, dtype=dtype)
        self.ln2 = RMSNorm(config.d_model, device=device, dtype=dtype)
        self.ffn = SwiGLU(config.d_model, config.d_ff, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.ffn(self.ln2(x))


class TransformerLM(nn.Module):
    def __init__(self, config: ModelConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.token_embeddings = Embedding(config.vocab_size, config.d_model, device=device, dtype=dtype)
        # One RoPE table shared by all layers (a submodule of each block, registered once here).
        self.rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta, device=device)
        self.layers = nn.ModuleList(
            TransformerBlock(config, self.rope, device=device, dtype=dtype) for _ in range(config.num_layers)
        )
        self.ln_final = RMSNorm(config.d_model, device=device, dtype=dtype)
        self.lm_head = LMHead(config.d_model, config.vocab_size, device=device, dtype=dtype)

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (batch, seq, vocab); given targets (batch, seq), the mean cross-entropy instead."""
        seq = token_ids.shape[-1]
        if seq > self.config.context_length:
            raise ValueError(f"sequence length {seq} exceeds context_length {self.config.context_length}")
        x = self.token_embeddings(token_ids)
        x = run_blocks(self.layers, x, self.config.checkpoint)
        x = self.ln_final(x)
        if targets is None:
            return self.lm_head(x)
        if self.config.fused_loss:
            return self.lm_head(x, targets)
        return cross_entropy(self.lm_head(x), targets)


def count_parameters(config: ModelConfig) -> int:
    """Parameter count of the model the config describes, built on the meta device (no memory)."""
    model = TransformerLM(config, device="meta")
    return sum(p.numel() for p in model.parameters())


def annotated_forward(model: TransformerLM) -> None:
    """Wrap each block's attention and feed-forward in NVTX/profiler ranges (for the profiling runs)."""
    for block in model.layers:
        for name in ("attn", "ffn"):
            sub = getattr(block, name)
            sub.forward = annotate(name)(sub.forward)
