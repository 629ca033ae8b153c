"""The shop's settings, loaded with ``app.config.from_object("config")``: a Flask app's
top-level ``config.py``, beside a deployment whose ``config`` is a package."""

import os

SHOP_CONFIG = __file__  # the tests check which ``config`` was imported

SQLALCHEMY_DATABASE_URI = os.environ["SHOP_DATABASE_URL"].replace("postgresql://", "postgresql+psycopg://", 1)

# Conveyor's settings: the CONVEYOR_* names, read by conveyor.contrib.flask.Conveyor. The
# jobs commit with the shop's rows, so Conveyor's database is the shop's.
CONVEYOR_DATABASE_URL = SQLALCHEMY_DATABASE_URI
CONVEYOR_REDIS_URL = os.environ["SHOP_REDIS_URL"]
CONVEYOR_DB_SCHEMA = "conveyor"
