"""Command-line arguments are checked before anything connects."""

from __future__ import annotations

from typer.testing import CliRunner

from conveyor.cli.main import cli


def test_a_misspelt_status_is_refused_with_the_statuses() -> None:
    result = CliRunner().invoke(cli, ["jobs", "list", "--status", "deadd"])
    assert result.exit_code == 2
    assert "'deadd' is no job status" in result.output and "succeeded" in result.output
