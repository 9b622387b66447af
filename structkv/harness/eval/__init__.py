"""Offline evaluation: RULER, LongBench and needle grids, with one runner for every method."""
