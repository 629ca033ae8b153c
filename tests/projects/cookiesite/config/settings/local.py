"""Settings for a developer's machine."""

from .base import *  # noqa: F403

DEBUG = True
