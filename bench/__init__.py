"""Benchmarks of Conveyor against raw Celery; each prints ``name=value`` lines on stdout."""
