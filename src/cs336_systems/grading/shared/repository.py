"""What counts as a repository's own code, on both sides: a Python environment inside its folder (a
``.venv`` uv made, tox's ``.tox``, a ``site-packages``) holds libraries, not the repository's code."""

from __future__ import annotations

ENVIRONMENT_DIRS = frozenset({".venv", "venv", ".tox", "site-packages", "dist-packages"})
