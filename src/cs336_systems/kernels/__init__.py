"""Triton kernels, each beside its launcher and autograd wrapper (the Triton tutorials' layout):
FlashAttention-2 forward/backward, the weighted-sum example, and the fused pieces of the training step."""
