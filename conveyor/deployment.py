"""Loading a deployment's app module by module path, the way Django loads a project's
settings: from the deployment's directory (``CONVEYOR_ROOT``, default the current one),
never from site-packages, where only ``conveyor`` itself is installed."""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from conveyor.errors import ConfigurationError
from conveyor.settings import ConveyorSettings


def on_path(settings: ConveyorSettings) -> str:
    """Put the deployment's directory first on ``sys.path``; returns it."""
    root = str(settings.resolved_root())
    if sys.path[:1] != [root]:
        if root in sys.path:
            sys.path.remove(root)
        sys.path.insert(0, root)
    return root


def import_object(path: str, settings: ConveyorSettings | None = None) -> Any:
    """``module`` or ``module:attribute`` of the deployment, with a message that says where
    it was looked for when it is not there."""
    settings = settings or ConveyorSettings()
    root = on_path(settings)
    module, _, attr = path.partition(":")
    try:
        found: ModuleType = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if not exc.name or not module.startswith(exc.name.split(".")[0]):
            raise  # the deployment's module is there; something it imports is not
        raise ConfigurationError(
            f"cannot import {module!r} from {root} ({exc}): run Conveyor from the deployment's "
            "directory, or set CONVEYOR_ROOT to it; CONVEYOR_APP names the app module"
        ) from None
    if not attr:
        return found
    try:
        return getattr(found, attr)
    except AttributeError:
        raise ConfigurationError(f"{module} (in {found.__file__}) has no {attr!r}") from None


def load_app_module(settings: ConveyorSettings | None = None) -> ModuleType:
    """The deployment's app module (``CONVEYOR_APP``): it builds the Celery app and the
    ``platform``."""
    settings = settings or ConveyorSettings()
    module: ModuleType = import_object(settings.app, settings)
    if not hasattr(module, "platform"):
        raise ConfigurationError(
            f"{settings.app} (in {module.__file__}) builds no Conveyor `platform`: CONVEYOR_APP "
            "must name the deployment's app module (e.g. config.celery_app), and CONVEYOR_ROOT "
            "its directory if that is not the current one"
        )
    return module


__all__ = ["import_object", "load_app_module", "on_path"]
