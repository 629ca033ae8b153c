"""Chaos runs: many jobs, real workers, kills, a shutdown and a Redis wipe at random times."""
