"""Benchmarks (the workload mapper): each prints a table and writes JSON; none is a test."""
