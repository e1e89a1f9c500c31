"""The judging process: every input is made here, every reference computed here, every output of a
graded process compared here (never in the graded process). Run as a module (``python -m
cs336_systems.grading.judge``, ``__main__.py``) it is the judging process itself: ``judging`` is its loop,
``session`` plans the jobs and decides, ``runner`` starts and reads the workers, ``summary`` reports,
``families`` and one module per hook family judge; ``pytest_plugin`` is the same pieces under pytest.
Nothing is imported here, so that importing one of these modules costs only what it needs."""
