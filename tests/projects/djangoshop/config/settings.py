"""A Django project that calls a Conveyor deployment by stage name and runs a stage of its
own. The test that drives it passes the database and Redis through SHOP_* variables."""

import os
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
SECRET_KEY = "not-a-secret-test-only"
DEBUG = False
ALLOWED_HOSTS = ["*"]
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "conveyor.contrib.django",
    "shop",
]
ROOT_URLCONF = "config.urls"
WSGI_APPLICATION = "config.wsgi.application"  # Conveyor's HTTP API mounted at /conveyor
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("SHOP_DB_NAME", "shop"),
        "USER": os.environ.get("SHOP_DB_USER", "postgres"),
        "HOST": os.environ.get("SHOP_DB_HOST", "127.0.0.1"),
        "PORT": os.environ.get("SHOP_DB_PORT", "5432"),
    }
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
CONVEYOR = {
    "REDIS_URL": os.environ.get("SHOP_REDIS_URL", "redis://127.0.0.1:6379/0"),
    "APP": "config.celery_app",  # this project's own stages (shop/tasks.py)
    "QUEUES": ["shop"],
    "HOME": os.environ.get("SHOP_CONVEYOR_HOME", str(BASE_DIR / ".conveyor")),
    "TEST": {"REDIS_URL": os.environ.get("SHOP_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")},
}
