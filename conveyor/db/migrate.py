"""Run the platform's Alembic migrations programmatically (``conveyor db upgrade``)."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"


def alembic_config(engine: Engine, extra_locations: list[Path] | None = None) -> Config:
    """An Alembic config bound to ``engine``; deployments may add version locations."""
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    locations = [MIGRATIONS / "versions", *(extra_locations or [])]
    cfg.set_main_option("version_locations", " ".join(str(p) for p in locations))
    cfg.set_main_option("path_separator", "space")
    cfg.attributes["engine"] = engine
    return cfg


def upgrade(engine: Engine, extra_locations: list[Path] | None = None) -> None:
    """Bring the database to the newest revision of every migration branch."""
    command.upgrade(alembic_config(engine, extra_locations), "heads")
