"""Benchmarks: compared things run side by side in one process, and reported as ratios."""
