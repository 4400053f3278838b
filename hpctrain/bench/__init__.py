"""Benchmarks behind ``hpctrain bench``: every competitor measured in the same run."""
