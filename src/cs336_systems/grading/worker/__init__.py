"""The checks that run beside a student's code, in a worker process (``python worker/__main__.py``).

Every module here imports only the standard library, torch, triton and its siblings (relatively):
in a worker this folder is the package ``_cs336_grader``, and ``cs336_systems`` is the student's.
``tests/contract/test_worker_isolation.py`` holds that rule against the code.
"""
