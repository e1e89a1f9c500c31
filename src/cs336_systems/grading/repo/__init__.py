"""One repository's process (``python -m cs336_systems.grading.repo.repo_job``): on a network of its
own, it runs the judge over the repository's adapters file, then the course's own tests
(``course_tests``) and the leaderboard row (``leaderboard/``), and writes ``grade.json``,
``results.json`` and ``leaderboard.json``."""
