"""the demo's effects table moves into Conveyor's schema (on SQLite: takes its prefix)

Revision ID: d002
Revises: d001
"""

from __future__ import annotations

from conveyor.store.db.migrate import abandon, adopt

revision = "d002"
down_revision = "d001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    adopt(["demo_effects"])


def downgrade() -> None:
    abandon(["demo_effects"])
