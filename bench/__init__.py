"""Benchmarks that print JSON, each comparing orchestra against raw Ray in the same run."""
