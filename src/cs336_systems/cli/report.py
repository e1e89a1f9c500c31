"""``python -m cs336_systems.cli.report`` (or ``python -m cs336_systems.report``): benchmark JSON ->
tables, plots and writeup.md; ``--compare A.json B.json`` pairs the rows of two runs."""

from __future__ import annotations

import sys

from cs336_systems.report.writeup import main

if __name__ == "__main__":
    sys.exit(main())
