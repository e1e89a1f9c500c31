"""``python -m cs336_systems.report``: benchmark JSON -> tables, plots and writeup.md."""

from cs336_systems.report import main

raise SystemExit(main())
