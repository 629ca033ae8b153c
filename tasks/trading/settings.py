"""The trading family's settings (``CONVEYOR_TRADING``, JSON): where the broker, market
data and AI coach answer, the coach's HMAC key, the key that encrypts broker tokens, and
the seed's per-queue concurrency.

``token_key`` is a Fernet key (``python -c "from cryptography.fernet import Fernet;
print(Fernet.generate_key().decode())"``). Unset, the family keeps one in
``$CONVEYOR_HOME/trading/token.key`` (mode 0600), made on first use: enough for one
machine (the embedded default, the demo); a deployment with several hosts sets it.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator

from tasks.files.storage import S3Settings

SETTING = "CONVEYOR_TRADING"
BROKERS = ("coinbase", "binance")
QUEUES = {"import": "q_import", "score": "q_score", "sim": "q_sim", "digest": "q_digest"}


class TradingSettings(BaseModel):
    """``CONVEYOR_TRADING``."""

    model_config = ConfigDict(extra="forbid")

    broker_urls: dict[str, str] = {}  # by broker: {"coinbase": "https://…"}
    market_url: str | None = None
    ai_url: str | None = None
    ai_key_id: str | None = None
    ai_secret: SecretStr | None = None
    ai_timeout: float = Field(default=2.0, gt=0)  # the seed's AI_TIMEOUT_MS=2000
    token_key: SecretStr | None = None
    # Running at once across all workers, per queue (the seed's WORKER_CONCURRENCY_*).
    concurrency: dict[str, int] = {"import": 2, "score": 2, "sim": 4, "digest": 1}
    rate_limit_safety_ms: int = Field(default=250, ge=0)  # the seed's BROKER_RATE_LIMIT_SAFETY_MS
    score_batch: int = Field(default=200, ge=1, le=1000)
    # Where the weekly digests' JSON snapshots go: an S3 bucket, else a local directory
    # (default $CONVEYOR_HOME/trading), under digests/{userId}/{start}-{end}.json.
    s3: S3Settings | None = None
    storage_dir: Path | None = None
    sim_cache_ttl: float = Field(default=3600.0, gt=0)  # the seed's result cache, 1 h
    ohlcv_cache_ttl: float = Field(default=3600.0, gt=0)

    @field_validator("broker_urls")
    @classmethod
    def _brokers(cls, value: dict[str, str]) -> dict[str, str]:
        for broker, url in value.items():
            if broker not in BROKERS:
                raise ValueError(f"{SETTING}.broker_urls: unknown broker {broker!r} ({', '.join(BROKERS)})")
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{SETTING}.broker_urls.{broker} must start with http:// or https://")
        return {broker: url.rstrip("/") for broker, url in value.items()}

    @field_validator("market_url", "ai_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith(("http://", "https://")):
            raise ValueError(f"{SETTING}: URLs must start with http:// or https://")
        return None if value is None else value.rstrip("/")

    @field_validator("concurrency")
    @classmethod
    def _limits(cls, value: dict[str, int]) -> dict[str, int]:
        for name, limit in value.items():
            if name not in QUEUES:
                raise ValueError(f"{SETTING}.concurrency: unknown stage {name!r} ({', '.join(QUEUES)})")
            if limit < 1:
                raise ValueError(f"{SETTING}.concurrency.{name} must be at least 1")
        return {"import": 2, "score": 2, "sim": 4, "digest": 1, **value}


def trading_settings_of(settings: object, default: TradingSettings | None = None) -> TradingSettings:
    """``CONVEYOR_TRADING`` of a platform's settings (a deployment without the family's
    settings: ``default``, else the defaults)."""
    found = getattr(settings, "trading", None)
    return found if isinstance(found, TradingSettings) else default or TradingSettings()


__all__ = ["BROKERS", "QUEUES", "SETTING", "TradingSettings", "trading_settings_of"]
