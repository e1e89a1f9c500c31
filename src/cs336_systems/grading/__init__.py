"""Grading another implementation through its adapters file: the graded code computes in processes of
its own; this package makes every input and reference and decides every verdict.

Students' packages are named ``cs336_systems`` like this suite's, and code that wants a better grade can
do anything inside its own process. So the judging process never imports the student's code and never
trusts what it writes: ``worker/`` (loaded by each worker as the private package ``_cs336_grader``) runs
the hooks on the judge's inputs and saves tensors; ``runner`` starts and watches the workers and reads
their records as untrusted data (``exchange``); ``judge/`` makes the inputs, computes the references and
compares; ``session`` decides; ``summary`` reports. ``worker/cases.py`` is the one table of cases both
sides read. A class: ``classroom`` (side by side), ``repo_job`` (one repository), ``class_report``,
``gradescope``. ``course_tests`` runs the course's own tests for comparison.
"""
