"""Every Conveyor name the README shows an app or a deployment still imports: the layout
may move modules (issue #28 grouped them by side), never a name people were shown."""

from __future__ import annotations

import importlib
import pkgutil
import re
from pathlib import Path
from typing import Any

import pytest

import conveyor

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
# Dotted names in prose and code, and `from conveyor… import a, b` lines in code blocks.
DOTTED = set(re.findall(r"(?<![\w./-])(conveyor(?:\.[A-Za-z_]\w*)+)", README))
IMPORTS = re.findall(r"^\s*from (conveyor[\w.]*) import ([\w, ]+(?: as \w+)?)", README, flags=re.M)
# `conveyor.<x>` names a module or a public attribute; else a stage (conveyor.demo.square),
# a span (conveyor.submit), a span attribute or a table, which are not Python names.
MODULES = {m.name for m in pkgutil.iter_modules(conveyor.__path__)}


def _python_name(dotted: str) -> bool:
    first = dotted.split(".")[1]
    return first in MODULES or first[0].isupper() or first == "connect"


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: Any = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attribute in parts[cut:]:
            found = getattr(found, attribute)
        return found
    raise ModuleNotFoundError(dotted)


SHOWN = sorted(name for name in DOTTED if _python_name(name))
IMPORTED = sorted(
    {
        f"{module}.{name.split(' as ')[0].strip()}"
        for module, names in IMPORTS
        for name in names.split(",")
        if name.strip()
    }
)


def test_the_readme_shows_names_to_check() -> None:
    assert "conveyor.shared.stage" in SHOWN and "conveyor.connect" in SHOWN
    assert "conveyor.contrib.celery.router" in IMPORTED


@pytest.mark.parametrize("dotted", SHOWN + IMPORTED)
def test_every_name_the_readme_shows_imports(dotted: str) -> None:
    assert _resolve(dotted) is not None


def test_the_names_that_moved_sides_keep_their_old_paths() -> None:
    """Stage code imports JobContext from conveyor.context, and apps the client from
    conveyor.client: both are now packages' or re-exports' names."""
    from conveyor.client import AsyncClient, Client, connect
    from conveyor.context import JobContext
    from conveyor.worker.context import JobContext as OnTheWorkersSide

    assert JobContext is OnTheWorkersSide
    assert connect is conveyor.connect and Client is conveyor.Client and AsyncClient is conveyor.AsyncClient
