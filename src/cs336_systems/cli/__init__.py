"""Command-line entry points (``python -m cs336_systems.cli.NAME``)."""
