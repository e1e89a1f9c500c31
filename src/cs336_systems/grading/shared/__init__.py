"""What the judging process and the worker processes both load: the one table of cases (``cases``), the
models and training recipes both sides build the same way (``models``, ``course_layers``, ``training``),
and the parent clock's protocol (``clock``).

Named for that property, not for a content: its modules are loaded beside a student's code too, so
every one imports only the standard library, torch and its siblings (relatively), never the suite's
package by name nor anything of the judge. In a worker this folder is ``_cs336_grader.shared``, loaded
by ``worker/__main__.py`` beside ``_cs336_grader.worker``; ``tests/contract/test_worker_isolation.py``
holds these rules against the code.
"""
