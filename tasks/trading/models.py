"""The trading family's payloads: the seed's field names (no aliases, so a Node producer
posts them unchanged), ids and dates, never trades or tokens.

``userId`` is a plain name (keys, lease names, labels and storage paths carry it): 1-64
letters, digits, ``.``, ``_`` or ``-``, never ``.`` or ``..``, so never an e-mail address.
"""

from __future__ import annotations

import datetime as dt
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool

IMPORT_STAGE = "conveyor.trading.import_trades"
SCORE_STAGE = "conveyor.trading.score_bias"
SIM_STAGE = "conveyor.trading.simulate_simple"
DIGEST_STAGE = "conveyor.trading.digest_weekly"
FANOUT_STAGE = "conveyor.trading.digest_fanout"
LEASE_KEY = "trading:{userId}"
# 1-64 of [A-Za-z0-9._-], never "." or "..", written without a look-ahead so that every
# regex engine reads it (pydantic's, a client's JSON Schema check, an OpenAPI tool).
USER_ID_PATTERN = (
    r"^(?:[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}|\.[A-Za-z0-9_-][A-Za-z0-9._-]{0,62}|\.\.[A-Za-z0-9._-]{1,62})$"
)

_USER = Field(pattern=USER_ID_PATTERN, description="a plain user id: 1-64 of A-Z a-z 0-9 . _ -")
# A day as the seed's producers send it, "YYYY-MM-DD" and nothing else (a date type would
# also take a number or a datetime); a day the calendar lacks (02-30) is refused at run.
DAY_PATTERN = r"^[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])$"


class ImportJob(BaseModel):
    """``conveyor.trading.import_trades`` (``q_import``): one user's trades since a day."""

    model_config = ConfigDict(extra="forbid")

    userId: str = _USER
    sinceIso: str | None = Field(
        default=None,
        pattern=DAY_PATTERN,
        json_schema_extra={"format": "date"},
        description="YYYY-MM-DD, inclusive; absent: UTC today - 30 days",
    )
    broker: Literal["coinbase", "binance"] | None = Field(
        default=None, description="absent: the user's connected broker"
    )


class ScoreJob(BaseModel):
    """``conveyor.trading.score_bias`` (``q_score``): tag the user's trades since a day."""

    model_config = ConfigDict(extra="forbid")

    userId: str = _USER
    sinceIso: str | None = Field(
        default=None,
        pattern=DAY_PATTERN,
        json_schema_extra={"format": "date"},
        description="YYYY-MM-DD, inclusive; absent: UTC today - 30 days",
    )
    retag: StrictBool = Field(
        default=True,
        description="tag every trade of the window again (the seed's re-score); false: only "
        "trades without a tag (what an import submits, so a trade is told once)",
    )


class SimJob(BaseModel):
    """``conveyor.trading.simulate_simple`` (``q_sim``): hold vs. actual after one trade."""

    model_config = ConfigDict(extra="forbid")

    userId: str = _USER
    tradeId: str = Field(min_length=1, max_length=36, description="the stored trade's id")
    horizonDays: int = Field(ge=1, le=365, description="days after the trade, 1-365")


class DigestJob(BaseModel):
    """``conveyor.trading.digest_weekly`` (``q_digest``): one user's period, end exclusive."""

    model_config = ConfigDict(extra="forbid")

    userId: str = _USER
    periodStart: dt.date = Field(description="YYYY-MM-DD, inclusive")
    periodEnd: dt.date = Field(description="YYYY-MM-DD, exclusive; at most 31 days after the start")


class FanoutJob(BaseModel):
    """``conveyor.trading.digest_fanout``: a digest for every user of a week."""

    model_config = ConfigDict(extra="forbid")

    week: dt.date | None = Field(
        default=None, description="any day of the ISO week (Monday to Monday); absent: last week"
    )


__all__ = [
    "DAY_PATTERN",
    "DIGEST_STAGE",
    "FANOUT_STAGE",
    "IMPORT_STAGE",
    "LEASE_KEY",
    "SCORE_STAGE",
    "SIM_STAGE",
    "USER_ID_PATTERN",
    "DigestJob",
    "FanoutJob",
    "ImportJob",
    "ScoreJob",
    "SimJob",
]
