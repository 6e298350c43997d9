"""Benchmarks and locust workloads."""
