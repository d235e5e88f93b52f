"""Benchmarks and load generators for tokenmesh (traffic to 127.0.0.1 only, bounded runs)."""
