"""The measuring rig: everything that knows pytest-benchmark or spawns measured runs, and the one
:class:`~cs336_systems.harness.settings.Settings` object that reads the ``CS336_*`` knobs. Library
packages (model, attention, kernels, distributed, profiling, accounting) never import it."""
