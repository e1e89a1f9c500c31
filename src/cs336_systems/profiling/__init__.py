"""Timing, profiler, memory and FLOP accounting helpers shared by the CLI and the bench cases."""
