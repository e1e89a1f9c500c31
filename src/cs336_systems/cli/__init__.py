"""Entry points: ``python -m cs336_systems.cli.benchmark`` (handout 1.1.3) and
``python -m cs336_systems.cli.report`` (benchmark JSON -> writeup; also ``python -m cs336_systems.report``)."""
