"""Benchmarks that print a table and write JSON under bench/results/."""
