"""This deployment's settings: the platform's, plus what the stage families need."""

from __future__ import annotations

from functools import lru_cache

from conveyor.settings import ConveyorSettings


class Settings(ConveyorSettings):
    """All settings (env prefix ``CONVEYOR_``)."""


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings of this process, read once from the environment."""
    return Settings()
