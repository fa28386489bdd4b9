"""Benchmark harness for mirrorspec: every decoding mode, side by side, on real prompt sets.

Run ``python -m benchmarks --help``. The entry point is ``benchmarks.run.main(argv) -> int`` so
that the package CLI can expose it as ``mirrorspec bench``. Kept import-light on purpose: the
prompt loaders can be used without loading torch models.
"""
