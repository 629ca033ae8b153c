"""Integrations with web frameworks; each module imports its framework, nothing else does."""
