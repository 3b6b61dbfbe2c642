"""The building blocks of the benchmarks in ``bench/``."""
