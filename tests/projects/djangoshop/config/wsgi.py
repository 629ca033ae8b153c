"""The shop as a WSGI application, with Conveyor's HTTP API under /conveyor (on
conveyor.contrib.django.client(): the shop's database and CONVEYOR settings)."""

import os

from django.core.wsgi import get_wsgi_application

from conveyor.contrib.django.api import mount

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

application = mount(get_wsgi_application(), "/conveyor")
