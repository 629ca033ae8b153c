"""Lease owners name their node (host, boot, PID namespace): only an owner of this very node
has a pid this process may judge; any other owner is judged by its lease alone."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conveyor.runfile import BOOT_ID, local_node, local_pid, owner_id
from conveyor.store.claims import _owner_dead


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_the_node_names_host_boot_and_pid_namespace() -> None:
    host, boot, namespace = local_node().split("/")
    assert host == socket.gethostname()[:64]
    assert boot == Path(BOOT_ID).read_text().strip().replace("-", "")[:16]
    assert namespace == Path("/proc/self/ns/pid").readlink().name.strip("pid:[]")


def test_only_owners_of_this_node_have_a_pid_to_judge() -> None:
    host, boot, namespace = local_node().split("/")
    other_boot = f"{int(boot, 16) ^ 1:016x}"
    assert local_pid(owner_id(123)) == 123
    assert local_pid(owner_id(123, thread=77)) == 123
    assert local_pid(f"{host}/{other_boot}/{namespace}:123") is None  # same name, another host
    assert local_pid(f"{host}/{boot}/4026532999:123") is None  # another container
    assert local_pid(f"{host}/{namespace}:123") is None  # an owner in the old format
    for garbage in ("", ":", "123", f"{local_node()}:", f"{local_node()}:abc", "x:y:z"):
        assert local_pid(garbage) is None


def test_a_dead_pid_is_proof_only_on_this_node() -> None:
    host, boot, namespace = local_node().split("/")
    pid = _gone_pid()
    assert _owner_dead(owner_id(pid))
    assert not _owner_dead(owner_id())  # this very process
    assert not _owner_dead(f"{host}/{f'{int(boot, 16) ^ 1:016x}'}/{namespace}:{pid}")
    assert not _owner_dead(f"{host}/{namespace}:{pid}")  # root namespaces share one inode
    assert not _owner_dead("not an owner")


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_fresh_pid_namespace_with_the_same_name_is_another_node() -> None:
    code = "from conveyor.runfile import local_node; print(local_node())"
    inner = f"hostname {socket.gethostname()} && {sys.executable} -c '{code}'"
    out = subprocess.run(
        ["unshare", "--uts", "--pid", "--fork", "--mount-proc", "sh", "-c", inner],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip(f"unshare is not permitted here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    theirs = out.stdout.strip()
    assert theirs.split("/")[:2] == local_node().split("/")[:2]  # same name, same kernel
    assert theirs != local_node()


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare (util-linux)")
def test_a_process_whose_proc_is_not_its_own_judges_no_pid() -> None:
    # A new PID namespace without its own /proc: /proc/self names another process.
    code = (
        "from conveyor.runfile import local_node, local_pid, owner_id; "
        "print(local_node(), local_pid(owner_id()), local_pid(owner_id(12345)))"
    )
    out = subprocess.run(
        ["unshare", "--pid", "--fork", sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip(f"unshare is not permitted here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    node, own, other = out.stdout.split()
    assert node.split("/")[0] == socket.gethostname()[:64] and node.split("/")[1].startswith("x")
    assert node.count("/") == 1 and (own, other) == ("None", "None")
