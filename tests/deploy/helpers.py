"""Reading the deploy/ files, and checking that the commands they run exist."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import yaml
from typer.testing import CliRunner

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"

# A URL's password: anything between "user:" and "@" in scheme://user:password@host.
URL_PASSWORD = re.compile(r"://[^:/@\s]*:([^@\s]*)@")


def tool(name: str) -> str:
    """The venv's console script ``name`` (beside this interpreter), else one on PATH."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


def load_all(path: Path) -> list[dict[str, Any]]:
    """Every YAML document of ``path`` (empty ones skipped)."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def assert_cli_accepts(command: list[str]) -> None:
    """``conveyor ...`` as a deploy file runs it: the sub-command and its options exist
    (parsed by the real CLI, with ``--help`` so nothing runs)."""
    from conveyor.cli.main import cli

    assert command and command[0] == "conveyor", command
    result = CliRunner().invoke(cli, [*command[1:], "--help"])
    assert result.exit_code == 0, f"{command}: {result.output}"


def assert_no_literal_password(text: str, where: str) -> None:
    """Every password inside a URL of ``text`` is a variable, or an obvious dev default."""
    for match in URL_PASSWORD.finditer(text):
        password = match.group(1)
        ok = password.startswith("${") or password == "PASSWORD" or "dev-only" in password
        assert ok, f"{where}: literal password in {match.group(0)!r}"
