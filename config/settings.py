"""This deployment's settings: the platform's, plus what the stage families need."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel

from conveyor.settings import ConveyorSettings
from tasks.email.settings import EmailSettings
from tasks.files.storage import S3Settings
from tasks.publisher.settings import PublisherSettings
from tasks.trading.settings import TradingSettings


class FilesSettings(BaseModel):
    """The files family (``CONVEYOR_FILES`` as JSON, e.g. ``{"max_pages": 200}``)."""

    storage_dir: Path | None = None  # default: <home>/files
    s3: S3Settings | None = None  # an S3-compatible bucket; unset: the local directory
    max_bytes: int = 25 * 1024 * 1024
    max_pages: int = 500
    embedder: str = "wordllama-256"  # or "minilm" (the embeddings extra), "hashing-v1", a URL
    chunk_tokens: int = 200
    chunk_overlap: int = 40
    extract_soft_time_limit: float = 60.0
    stale_upload_after: float = 3600.0  # an upload still unfinished this long died: swept
    # Per stage, across all workers (the seed's figures). A worker's own pool stays within
    # twice the cores (``worker_concurrency``), so on one small machine the pool binds first.
    # ``CONVEYOR_STAGES`` overrides one stage; ``CONVEYOR_RATE_LIMITS`` limits the queue.
    concurrency: dict[str, int] = {"extract": 8, "chunk": 5, "embed": 5}


class Settings(ConveyorSettings):
    """All settings (env prefix ``CONVEYOR_``)."""

    files: FilesSettings = FilesSettings()
    email: EmailSettings = EmailSettings()  # CONVEYOR_EMAIL, JSON (tasks/email/settings.py)
    # CONVEYOR_PUBLISHER, JSON (tasks/publisher/settings.py)
    publisher: PublisherSettings = PublisherSettings()
    trading: TradingSettings = TradingSettings()  # CONVEYOR_TRADING, JSON (tasks/trading/settings.py)

    def files_storage_dir(self) -> Path:
        """Where local file contents live."""
        path = self.files.storage_dir or (self.resolved_home() / "files")
        path.mkdir(parents=True, exist_ok=True)
        return path


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The settings of this process, read once from the environment."""
    return Settings()
