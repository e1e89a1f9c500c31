"""Calls run as jobs, on Slurm or on this machine, for the bench sweep (``harness/sweep.py``) and the
class run (``grading/class_run/class_executor.py``) alike: the executor's options (``executor``), running
and watching the jobs (``run``), and what an interruption does on both sides (``interrupt``).

A leaf: the standard library and submitit only, importing nothing else of the package, so that the
grader need not import the harness (nor the harness the grader) to share it, and the commands can
import it before torch."""
