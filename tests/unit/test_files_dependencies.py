"""The files family's parsers are pinned past their known denial-of-service fixes: pypdf's
decompression-bomb and infinite-loop fixes landed in the 6.x series, so the declared floor
(and what is installed) must be 6 or later."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _floor(distribution: str) -> Version:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = [
        *project["dependencies"],
        *(d for ds in project.get("optional-dependencies", {}).values() for d in ds),
    ]
    specs = [d for d in declared if re.match(rf"{distribution}\s*[<>=!~;\[]", d)]
    assert specs, f"{distribution} is not declared"
    lowest: list[Version] = []
    for spec in specs:  # every extra that declares it (files, operations) has a floor
        floors = re.findall(r">=\s*([0-9][0-9.]*)", spec)
        assert floors, f"{distribution} has no lower bound: {spec!r}"
        lowest.append(Version(floors[0]))
    return min(lowest)


def test_pypdf_floor_is_past_its_dos_fixes() -> None:
    assert _floor("pypdf") >= Version("6"), _floor("pypdf")
    assert Version(version("pypdf")) >= _floor("pypdf")
