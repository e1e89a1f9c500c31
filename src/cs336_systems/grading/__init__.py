"""Grading another implementation through its adapters file: the graded code computes in processes of
its own; this package makes every input and reference and decides every verdict.

Students' packages are named ``cs336_systems`` like this suite's, and code that wants a better grade can
do anything inside its own process. So the judging process never imports the student's code and never
trusts what it writes. A folder per process, each importing only the ones below it: ``class_run/`` (a
class's parent: the schedulers, the class report), ``repo/`` (one repository's job: the judge, the
course's own tests, ``leaderboard/``), ``judge/`` (the judging process: inputs, references, verdicts;
``judge/runner`` starts and watches the workers and reads their records as untrusted data through
``exchange``). ``worker/`` (loaded only by each worker, as the private package ``_cs336_grader.worker``)
runs the hooks on the judge's inputs and saves tensors; ``shared/`` is what both sides load
(``shared/cases.py``, the one table of cases; the models, training recipes and the clock's protocol).
The modules at this level are what two processes or more load (``settings``, ``roots``, ``sandbox``,
``verdict``, ``gradescope``, ...).
"""
