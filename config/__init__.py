"""How this deployment is wired: settings, queues and routes, the one Celery app.

What ``conveyor`` reads before any app exists is declared here, cheap to import:
``CLI_EXTENSIONS``, the command groups this deployment adds (``conveyor files …``), so
``conveyor --help`` lists them without building the Celery app of ``config.celery_app``.
"""

from __future__ import annotations

import importlib.util

# A family whose extra is not installed is left out, and says so (the demo still runs).
FILES_EXTRA = ("numpy", "pypdf", "docx", "lxml", "markdown_it", "charset_normalizer", "puremagic")
HAS_FILES = all(importlib.util.find_spec(m) is not None for m in FILES_EXTRA)

EMAIL_EXTRA = ("email_validator", "aiosmtpd")
HAS_EMAIL = all(importlib.util.find_spec(m) is not None for m in EMAIL_EXTRA)

PUBLISHER_EXTRA = ("tzdata",)
HAS_PUBLISHER = all(importlib.util.find_spec(m) is not None for m in PUBLISHER_EXTRA)

TRADING_EXTRA = ("httpx", "cryptography", "numpy")
HAS_TRADING = all(importlib.util.find_spec(m) is not None for m in TRADING_EXTRA)

CLI_EXTENSIONS = {
    **({"files": "pipelines.files.cli:app"} if HAS_FILES else {}),
    **({"email": "pipelines.email.cli:app"} if HAS_EMAIL else {}),
    **({"publisher": "pipelines.publisher.cli:app"} if HAS_PUBLISHER else {}),
    **({"trading": "pipelines.trading.cli:app"} if HAS_TRADING else {}),
}
