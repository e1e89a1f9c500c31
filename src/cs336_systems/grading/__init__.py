"""Grading another implementation through its adapters file, in processes of its own.

Students' packages are named ``cs336_systems`` like this suite's, and one interpreter cannot hold two
packages of one name. So the pytest process that collects and reports never imports the student's
code: every check runs in a *worker* process (``worker/``) whose ``sys.path`` holds the student's
roots and not the suite's, and which reaches the suite's checking code under the private package
name ``_cs336_grader`` (``worker/__main__.py`` installs it). ``roots`` finds the student's roots from
the adapters path, ``runner`` starts and watches the workers, ``summary`` prints the hook x tier table.
"""
