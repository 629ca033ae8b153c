"""Settings every environment shares (cookiecutter-django's layout: base, then local,
test, production). The test that runs the site passes its services as SITE_* variables."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent.parent
SECRET_KEY = "not-a-secret-test-only"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "conveyor.contrib.django",
    "shop",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SITE_DB_NAME", "shop"),
        "USER": os.environ.get("SITE_DB_USER", "postgres"),
        "PASSWORD": os.environ.get("SITE_DB_PASSWORD", ""),
        "HOST": os.environ.get("SITE_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SITE_DB_PORT", "5432"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# Conveyor: its tables in the default database, its Redis.
CONVEYOR = {"REDIS_URL": os.environ.get("SITE_REDIS_URL", "redis://127.0.0.1:6379/0")}
if os.environ.get("SITE_BROKER_URL"):  # the workers use RabbitMQ
    CONVEYOR["BROKER_URL"] = os.environ["SITE_BROKER_URL"]

# The site's own Celery app sends to Conveyor's workers: their broker (CONVEYOR["BROKER_URL"]
# when they use RabbitMQ, else Conveyor's Redis) and Conveyor's Redis for the results.
CELERY_BROKER_URL = CONVEYOR.get("BROKER_URL", CONVEYOR["REDIS_URL"])
CELERY_RESULT_BACKEND = CONVEYOR["REDIS_URL"]
