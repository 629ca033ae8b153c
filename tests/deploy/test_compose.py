"""deploy/compose.yaml: valid against the Compose specification's schema, and every
process and service of a deployment present with a health check that means something."""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest
import yaml

from conveyor.settings import ConveyorSettings
from tests.deploy.helpers import DEPLOY, assert_cli_accepts, assert_no_literal_password, tool

COMPOSE = DEPLOY / "compose.yaml"

# service → the command it must run (None: a service image's own).
REQUIRED: dict[str, list[str] | None] = {
    "web": ["conveyor", "serve"],
    "worker": ["conveyor", "worker"],
    "beat": ["conveyor", "beat"],
    "flower": ["conveyor", "flower"],
    "redis": None,
    "postgres": None,
    "rabbitmq": None,
}
CONVEYOR = [name for name, command in REQUIRED.items() if command]


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(doc, dict) and doc.get("services"), "compose.yaml has no services"
    return doc


def test_compose_validates_against_the_compose_spec() -> None:
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(COMPOSE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ok -- validation done" in result.stdout


def test_the_schema_check_is_not_vacuous(tmp_path: Any) -> None:
    """The same check refuses a broken file (a service's health check misspelt)."""
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("healthcheck:", "healthchek:", 1))
    result = subprocess.run(
        [tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(broken)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0, result.stdout


@pytest.mark.parametrize("name", list(REQUIRED))
def test_every_service_is_present_with_a_health_check(compose: dict[str, Any], name: str) -> None:
    service = compose["services"].get(name)
    assert service is not None, f"no service {name!r} in compose.yaml"
    check = service.get("healthcheck")
    assert check and not check.get("disable"), f"{name} has no health check"
    test = check.get("test")
    assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, test
    command = REQUIRED[name]
    if command:
        assert service["command"][: len(command)] == command, service["command"]
        if test[0] == "CMD" and test[1] == "conveyor":
            assert_cli_accepts(test[1:])
        assert_cli_accepts(service["command"])


def test_no_separate_relay_the_workers_run_it(compose: dict[str, Any]) -> None:
    assert not [n for n in compose["services"] if "relay" in n or "reconciler" in n]
    assert "-Q" not in compose["services"]["worker"]["command"]  # every declared queue


def test_conveyor_services_reach_every_service(compose: dict[str, Any]) -> None:
    for name in [*CONVEYOR, "migrate"]:
        env = compose["services"][name]["environment"]
        assert env["CONVEYOR_DATABASE_URL"].startswith("postgresql://"), name
        assert env["CONVEYOR_REDIS_URL"].startswith("redis://redis:"), name
        assert env["CONVEYOR_BROKER_URL"].startswith("amqp://"), name
        assert "@rabbitmq:5672/" in env["CONVEYOR_BROKER_URL"], name
        depends = compose["services"][name]["depends_on"]
        assert depends.get("postgres" if name == "migrate" else "migrate"), name
    for name in CONVEYOR:
        depends = compose["services"][name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully", name
        for service in ("redis", "rabbitmq"):
            assert depends[service]["condition"] == "service_healthy", (name, service)


def test_passwords_come_from_the_environment() -> None:
    text = COMPOSE.read_text()
    assert_no_literal_password(text, "compose.yaml")
    settings = list(re.finditer(r"^\s*[A-Z_]*(PASSWORD|PASS): +(\S+)", text, re.MULTILINE))
    assert len(settings) >= 3  # Postgres's, RabbitMQ's, Flower's
    for match in settings:
        assert match.group(2).startswith("${"), match.group(0)
    example = (DEPLOY / ".env.example").read_text()
    for variable in set(re.findall(r"\$\{(CONVEYOR_[A-Z_]+)", text)):
        assert f"{variable}=" in example, f"{variable} missing from deploy/.env.example"


def _seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", value)
    assert match, value
    return float(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_worker_is_given_time_for_its_bounded_shutdown(compose: dict[str, Any]) -> None:
    bound = ConveyorSettings.model_fields["soft_shutdown_timeout"].default
    assert _seconds(compose["services"]["worker"]["stop_grace_period"]) >= bound + 10


def test_the_image_compose_builds_exists(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        build = service.get("build")
        if build:
            dockerfile = (COMPOSE.parent / build["context"] / build["dockerfile"]).resolve()
            assert dockerfile.is_file(), (name, dockerfile)
            text = dockerfile.read_text()
            for directory in ("conveyor", "config", "tasks", "pipelines"):
                assert f"COPY {directory} " in text, directory
