"""Migration locations of this deployment: the platform's plus each stage family's."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine

from conveyor.store.db.migrate import upgrade as platform_upgrade

ROOT = Path(__file__).resolve().parent.parent
FAMILY_MIGRATIONS = [
    ROOT / "tasks" / "demo" / "migrations",
    ROOT / "tasks" / "files" / "migrations",
    ROOT / "tasks" / "email" / "migrations",
    ROOT / "tasks" / "publisher" / "migrations",
    ROOT / "tasks" / "trading" / "migrations",
]


def upgrade(engine: Engine) -> None:
    """Upgrade platform and family tables to their newest revisions."""
    platform_upgrade(engine, FAMILY_MIGRATIONS)
