"""The course-like layers of the grading worker (one copy, used by the suite's own FSDP tests too)."""

from cs336_systems.grading.shared.course_layers import Embedding, Linear, RMSNorm

__all__ = ["Embedding", "Linear", "RMSNorm"]
