"""Reference implementations the class leaderboard times beside the students', through the same worker
path and the same parent's clock: ``cudnn_adapters.py`` (torch's SDPA on its cuDNN backend behind the
Triton hook). The suite's own kernel is timed through the suite's ``tests/adapters.py``."""
