"""deploy/k8s/: the built-in kinds pass ``kubernetes-validate --strict``, the KEDA objects
pass a schema derived from KEDA's models (``cloudcoil-models-keda``, with unknown fields
refused), and the manifests hang together: one ScaledObject per worker Deployment, on
exactly its queues, every declared queue consumed, probes that run real checks, grace
periods above the bounded shutdown, one beat."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from fastapi.testclient import TestClient

from conveyor.settings import ConveyorSettings
from tests.deploy.helpers import DEPLOY, assert_cli_accepts, assert_no_literal_password, load_all, tool

K8S = DEPLOY / "k8s"
BUILTIN_FILES = sorted(K8S.glob("*.yaml"))
KEDA_FILES = sorted((K8S / "keda").glob("*.yaml"))
KEDA_API = "keda.sh/v1alpha1"


def docs(files: list[Path]) -> list[dict[str, Any]]:
    return [doc for path in files for doc in load_all(path)]


def of_kind(kind: str, files: list[Path] = BUILTIN_FILES) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs(files) if d["kind"] == kind}


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def workers() -> dict[str, dict[str, Any]]:
    return {
        name: d
        for name, d in of_kind("Deployment").items()
        if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    }


def worker_queues(deployment: dict[str, Any]) -> list[str]:
    command = containers(deployment)[0]["command"]
    assert command[:2] == ["conveyor", "worker"] and "-Q" in command, command
    return list(command[command.index("-Q") + 1].split(","))


# -- schemas ---------------------------------------------------------------------------


def test_files_are_where_their_validator_looks() -> None:
    assert BUILTIN_FILES and KEDA_FILES
    for doc in docs(BUILTIN_FILES):
        assert not doc["apiVersion"].startswith("keda.sh/"), doc["metadata"]["name"]
    for doc in docs(KEDA_FILES):
        assert doc["apiVersion"] == KEDA_API, doc["metadata"]["name"]


@pytest.mark.parametrize("path", BUILTIN_FILES, ids=lambda p: p.name)
def test_builtin_kinds_pass_kubernetes_validate_strict(path: Path) -> None:
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(path)], capture_output=True, text=True, timeout=60
    )
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert "couldn't find schema" not in out.lower(), out
    assert out.count(" passed for resource ") == len(load_all(path)), out


def test_kubernetes_validate_strict_refuses_an_unknown_field(tmp_path: Path) -> None:
    broken = tmp_path / "beat.yaml"
    broken.write_text((K8S / "beat.yaml").read_text().replace("livenessProbe:", "livenesProbe:"))
    result = subprocess.run(
        [tool("kubernetes-validate"), "--strict", str(broken)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode != 0, result.stdout


def _forbid_unknown(schema: Any) -> Any:
    """KEDA's CRDs are structural: unknown fields are pruned (or refused under
    ``kubectl --validate=strict``). The models ignore them; refuse them here, so that a
    misspelt field fails instead of silently doing nothing."""
    if isinstance(schema, dict):
        if schema.get("type") == "object" and "properties" in schema:
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _forbid_unknown(value)
    elif isinstance(schema, list):
        for value in schema:
            _forbid_unknown(value)
    return schema


def keda_schema(kind: str) -> dict[str, Any]:
    """The JSON schema of KEDA ``kind``, from the models cloudcoil generated from KEDA's CRDs."""
    from cloudcoil.models.keda import v1alpha1

    model = getattr(v1alpha1, kind, None)
    assert model is not None, f"couldn't find schema for {kind} in cloudcoil.models.keda"
    schema = model.model_json_schema(by_alias=True, mode="validation")
    return dict(_forbid_unknown(schema))


def keda_errors(doc: dict[str, Any]) -> list[str]:
    validator = jsonschema.Draft202012Validator(keda_schema(doc["kind"]))
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


@pytest.mark.parametrize("path", KEDA_FILES, ids=lambda p: p.name)
def test_keda_objects_match_kedas_schema(path: Path) -> None:
    from cloudcoil.models.keda import v1alpha1

    for doc in load_all(path):
        assert keda_errors(doc) == [], doc["metadata"]["name"]
        getattr(v1alpha1, doc["kind"]).model_validate(doc)  # and the models themselves


def test_keda_schema_refuses_a_misspelt_field() -> None:
    doc = load_all(K8S / "keda" / "worker-core.yaml")[0]
    doc["spec"]["minReplicasCount"] = doc["spec"].pop("minReplicaCount")
    assert any("minReplicasCount" in e for e in keda_errors(doc))
    doc = load_all(K8S / "keda" / "worker-core.yaml")[0]
    doc["spec"]["triggers"][0]["authRef"] = doc["spec"]["triggers"][0].pop("authenticationRef")
    assert keda_errors(doc)


# -- coherence -------------------------------------------------------------------------


def test_one_scaled_object_per_worker_deployment_on_its_queues() -> None:
    scaled = of_kind("ScaledObject", KEDA_FILES)
    auths = of_kind("TriggerAuthentication", KEDA_FILES)
    targets = [s["spec"]["scaleTargetRef"]["name"] for s in scaled.values()]
    assert sorted(targets) == sorted(workers()), "every worker Deployment, and only those, is scaled once"
    for obj in scaled.values():
        deployment = workers()[obj["spec"]["scaleTargetRef"]["name"]]
        triggers = obj["spec"]["triggers"]
        assert {t["type"] for t in triggers} == {"rabbitmq"}
        assert sorted(t["metadata"]["queueName"] for t in triggers) == sorted(worker_queues(deployment))
        for trigger in triggers:
            assert trigger["metadata"]["mode"] == "QueueLength"
            assert int(trigger["metadata"]["value"]) > 0
            assert trigger["authenticationRef"]["name"] in auths
    # The relay and the reconciler run inside workers: the family holding them never idles at 0.
    assert min(s["spec"].get("minReplicaCount", 0) for s in scaled.values()) >= 0
    assert scaled["conveyor-worker-core"]["spec"]["minReplicaCount"] >= 1


def test_every_declared_queue_has_a_worker_family() -> None:
    from config.queues import QUEUES

    consumed = [q for d in workers().values() for q in worker_queues(d)]
    assert sorted(consumed) == sorted(q.name for q in QUEUES), "each queue in exactly one family"


def test_workers_probe_their_consumer_and_outlast_the_bounded_shutdown() -> None:
    bound = ConveyorSettings.model_fields["soft_shutdown_timeout"].default
    config = of_kind("ConfigMap")["conveyor-config"]["data"]
    bound = max(bound, float(config.get("CONVEYOR_SOFT_SHUTDOWN_TIMEOUT", bound)))
    assert len(workers()) >= 2
    for name, deployment in workers().items():
        spec = deployment["spec"]["template"]["spec"]
        assert spec["terminationGracePeriodSeconds"] >= bound + 10, name
        (container,) = spec["containers"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            command = container[probe]["exec"]["command"]
            assert command[:3] == ["conveyor", "probe", "worker"], (name, probe)
            assert_cli_accepts(command)
            assert container[probe]["timeoutSeconds"] >= 5, "a probe is a Python process"
            # A failed startup or liveness probe restarts the pod: they follow the worker's own
            # loop (--live), never the broker; readiness may follow the broker.
            assert ("--live" in command) == (probe != "readinessProbe"), (name, probe)
        assert "replicas" not in deployment["spec"], f"{name}: KEDA owns the replicas"


def test_one_beat_that_never_overlaps_itself() -> None:
    beat = of_kind("Deployment")["conveyor-beat"]
    assert beat["spec"]["replicas"] == 1
    assert beat["spec"]["strategy"]["type"] == "Recreate"
    (container,) = containers(beat)
    assert container["command"] == ["conveyor", "beat"]
    assert container["livenessProbe"]["exec"]["command"] == ["conveyor", "probe", "beat"]


def test_every_deployment_has_probes_and_runnable_commands() -> None:
    for name, deployment in of_kind("Deployment").items():
        for container in containers(deployment):
            assert_cli_accepts(container["command"])
            assert "livenessProbe" in container, name
            if name != "conveyor-beat":  # beat serves nothing: readiness would mean nothing
                assert "readinessProbe" in container, name
            refs = [e.get("secretRef", {}).get("name") for e in container.get("envFrom", [])]
            assert "conveyor-env" in refs, f"{name}: service URLs come from the Secret"
            for env in container.get("env", []):
                assert "value" not in env or "PASSWORD" not in env["name"], (name, env["name"])
    for job in of_kind("Job").values():
        assert_cli_accepts(job["spec"]["template"]["spec"]["containers"][0]["command"])


def test_no_literal_passwords() -> None:
    for path in [*BUILTIN_FILES, *KEDA_FILES]:
        assert_no_literal_password(path.read_text(), path.name)
    assert not of_kind("Secret"), "Secrets are created by hand, never shipped"


def test_web_probe_paths_mean_what_they_say() -> None:
    """Readiness (``/health``) needs the database; liveness (``/openapi.json``) does not, so
    a database outage takes web pods out of the Service without restarting them."""
    from conveyor.web.app import create_app

    web = containers(of_kind("Deployment")["conveyor-web"])[0]
    nowhere = ConveyorSettings(redis_url="redis://127.0.0.1:1/0", database_url="postgresql://x@127.0.0.1:1/x")
    with TestClient(create_app(nowhere)) as client:
        assert client.get(web["readinessProbe"]["httpGet"]["path"]).status_code == 503
        assert client.get(web["livenessProbe"]["httpGet"]["path"]).status_code == 200
