"""What a benchmark row is, shared by the harness (which writes rows) and the report (which reads them),
so that neither imports the other:

- ``schema``: every benchmark group, declared once; a bench names its group through ``tag(benchmark, key)``;
- ``contention``: the facts a row records about its machine and the one verdict on whether its timing is
  a result.

Plain Python (no torch, no pytest), importing nothing else of ``cs336_systems``: both layers above stand on
it, and ``tests/test_layout.py`` holds the harness and the report apart.
"""
