"""The publisher family's settings (``CONVEYOR_PUBLISHER``, JSON): the Graph API and its
tokens, blackout windows, per-channel concurrency and the retry schedule.

A window or zone that cannot be read stops the settings from loading, naming the key
(``CONVEYOR_PUBLISHER.blackout_windows[0].timezone: unknown time zone 'Europe/Rom'``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from conveyor.calendar import Window
from conveyor.errors import ConfigurationError

SETTING = "CONVEYOR_PUBLISHER"
CHANNELS = ("facebook", "instagram")


class Blackout(BaseModel):
    """A blackout window, for every post or only some brands' or channels'."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    window: Window
    brands: frozenset[str] = frozenset()  # empty: every brand
    channels: frozenset[str] = frozenset()  # empty: every channel

    def applies(self, brand: str, channel: str) -> bool:
        """Whether this window holds posts of ``brand`` on ``channel``."""
        return (not self.brands or brand in self.brands) and (not self.channels or channel in self.channels)

    def to_json(self) -> dict[str, Any]:
        """The window as configured."""
        out = self.window.to_json()
        if self.brands:
            out["brands"] = sorted(self.brands)
        if self.channels:
            out["channels"] = sorted(self.channels)
        return out


class RetryBackoff(BaseModel):
    """The seed's ``queue.retry_backoff``: ``base * factor**(attempt-1)`` seconds, at most
    ``max``, jittered."""

    model_config = ConfigDict(extra="forbid")

    base: float = Field(default=2.0, gt=0)
    factor: float = Field(default=2.0, ge=1)
    max: float = Field(default=300.0, gt=0)


class PublisherSettings(BaseModel):
    """``CONVEYOR_PUBLISHER``."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    graph_url: str = "https://graph.facebook.com/v19.0"
    tokens: dict[str, SecretStr] = {}  # per account; "*": every other account
    blackout_windows: tuple[Blackout, ...] = ()
    channel_concurrency: dict[str, int] = {channel: 2 for channel in CHANNELS}
    retry_backoff: RetryBackoff = RetryBackoff()
    max_attempts: int = Field(default=5, ge=1, le=100)
    timeout: float = Field(default=10.0, gt=0)

    @field_validator("graph_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"{SETTING}.graph_url must start with http:// or https://")
        return value.rstrip("/")

    @field_validator("blackout_windows", mode="before")
    @classmethod
    def _windows(cls, value: Any) -> Any:
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{SETTING}.blackout_windows must be a list of windows")
        out = []
        for i, item in enumerate(value):
            if isinstance(item, Blackout):
                out.append(item)
                continue
            where = f"{SETTING}.blackout_windows[{i}]"
            if not isinstance(item, dict):
                raise ValueError(f"{where}: a window is an object")
            data = dict(item)
            brands, channels = data.pop("brands", []), data.pop("channels", [])
            try:
                window = Window.from_json(data, where=where)
            except ConfigurationError as exc:
                raise ValueError(str(exc)) from None
            unknown = sorted(set(channels) - set(CHANNELS))
            if unknown:
                raise ValueError(f"{where}.channels: unknown channel {unknown[0]!r} ({', '.join(CHANNELS)})")
            out.append(Blackout(window=window, brands=frozenset(brands), channels=frozenset(channels)))
        return tuple(out)

    @field_validator("channel_concurrency")
    @classmethod
    def _limits(cls, value: dict[str, int]) -> dict[str, int]:
        for channel, limit in value.items():
            if channel not in CHANNELS:
                raise ValueError(f"{SETTING}.channel_concurrency: unknown channel {channel!r}")
            if limit < 1:
                raise ValueError(f"{SETTING}.channel_concurrency.{channel} must be at least 1")
        return {**{channel: 2 for channel in CHANNELS}, **value}

    def token_for(self, account: str) -> str | None:
        """The account's Graph token (or the ``"*"`` default), None when it has none."""
        token = self.tokens.get(account) or self.tokens.get("*")
        return None if token is None else token.get_secret_value()

    def windows_for(self, brand: str, channel: str) -> tuple[Window, ...]:
        """The blackout windows that hold posts of ``brand`` on ``channel``."""
        return tuple(b.window for b in self.blackout_windows if b.applies(brand, channel))


def publisher_settings_of(settings: object, default: PublisherSettings | None = None) -> PublisherSettings:
    """``CONVEYOR_PUBLISHER`` of a platform's settings (a deployment without the family's
    settings: ``default``, else the defaults)."""
    found = getattr(settings, "publisher", None)
    return found if isinstance(found, PublisherSettings) else default or PublisherSettings()


__all__ = ["CHANNELS", "SETTING", "Blackout", "PublisherSettings", "RetryBackoff", "publisher_settings_of"]
