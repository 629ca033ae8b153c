"""Integrations with the frameworks Conveyor is called from (Django, Flask): each module
imports its framework, and nothing else does."""
