"""Benchmark evaluation: answer extraction, scorers, retain ratios."""
