"""Scheduled publishing: the worker side (stages, Graph connectors, the post record)."""
