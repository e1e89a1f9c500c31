"""``python -m cs336_systems.report``: the same as ``python -m cs336_systems.cli.report``."""

from cs336_systems.report.writeup import main

raise SystemExit(main())
