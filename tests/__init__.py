"""Correctness tests. A package, so graders' test files can do ``from .adapters import ...``."""
