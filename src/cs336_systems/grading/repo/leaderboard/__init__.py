"""The leaderboard row of one repository (``row``, also run for the references as ``python -m
cs336_systems.grading.repo.leaderboard.row``): the judge's clock over a worker's iterations (``clock``),
what ran as Nsight Compute saw it (``observer``, one host's observed runs taking turns in
``observer_turn``), and the rank (``standing``). ``references/`` holds the adapters files timed beside."""
