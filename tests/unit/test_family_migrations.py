"""A family's migrations may depend on an early platform revision only. A revision a family
depends on leaves alembic's version table, so depending on the platform's newest one hides
the platform's head: another deployment on the same database (without that family) then
finds no platform revision it knows and refuses to upgrade ("migrated by a newer Conveyor";
the Django shop's suite found it)."""

from __future__ import annotations

import ast
from pathlib import Path

from config.migrations import FAMILY_MIGRATIONS

PLATFORM_VERSIONS = Path(__file__).resolve().parents[2] / "conveyor" / "store" / "migrations" / "versions"


def _assigned(path: Path, name: str) -> object:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    return None


def test_no_family_migration_depends_on_the_platforms_head() -> None:
    platform = {_assigned(p, "revision") for p in PLATFORM_VERSIONS.glob("0*.py")}
    head = max(str(r) for r in platform)
    for folder in FAMILY_MIGRATIONS:
        for path in folder.glob("*.py"):
            depends = _assigned(path, "depends_on")
            names = depends if isinstance(depends, (list, tuple)) else [depends]
            assert head not in names, f"{path.name} depends on the platform's head {head}: depend on 0011"
