"""The benchmarks are scripts (`python benchmarks/NAME.py`); this makes the folder importable
too, so a test can drive a benchmark's own workload (tests/server/test_soak.py runs a shortened
soak) through a normal import instead of loading a file by its path."""
