"""Data-parallel training pieces, one module each: process-group setup, launching ranks, all-reduce
benchmarking, the DDP family and optimizer state sharding."""
