"""conveyor.worker.isolate: bounded children, with real processes (no mocks)."""

from __future__ import annotations

import atexit
import ctypes
import faulthandler
import mmap
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from billiard.exceptions import SoftTimeLimitExceeded

from conveyor.errors import ChildFailed, OutOfBounds, PermanentError, TransientError, is_permanent
from conveyor.worker.isolate import ChildStats, peak_rss, run_bounded

MiB = 1 << 20
MEMORY = 256 * MiB


class DocumentBroken(PermanentError):
    """A ConveyorError the parent can import by module path."""


def _children() -> set[int]:
    """Pids whose parent is this process, zombies included."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == os.getpid():
            found.add(int(stat.parent.name))
    return found


@pytest.fixture(autouse=True)
def no_leftover_children() -> Iterator[None]:
    before = _children()
    yield
    assert _children() <= before, "a child was left running or unreaped"


def _gone_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _text(n: int) -> str:
    words = "héllo wörld ✓ \udcff 𝄞 "
    return (words * (n // len(words) + 1))[:n]


def _stats() -> tuple[list[ChildStats], Callable[[ChildStats], None]]:
    seen: list[ChildStats] = []
    return seen, seen.append


# --- results ---------------------------------------------------------------------------


def test_returns_a_json_value() -> None:
    value = run_bounded(lambda a, b=0: {"sum": a + b, "t": (1, None, "x")}, 2, b=3, memory=MEMORY, timeout=10)
    assert value == {"sum": 5, "t": [1, None, "x"]}


def test_returns_30mb_of_text_intact_and_quickly() -> None:
    started = time.monotonic()
    text = run_bounded(_text, 30_000_000, memory=MEMORY, timeout=20)
    elapsed = time.monotonic() - started
    assert len(text) == 30_000_000 and text == _text(30_000_000)  # astral, a lone surrogate too
    assert elapsed < 3, elapsed


def test_result_that_is_not_json_is_a_child_failure() -> None:
    with pytest.raises(ChildFailed, match="not JSON serializable") as info:
        run_bounded(lambda: {1, 2}, memory=MEMORY, timeout=10)
    assert info.value.type_name == "builtins.TypeError"


# --- memory ----------------------------------------------------------------------------


def _grow_list() -> None:
    chunks = []
    while True:
        chunks.append([0] * 1000)


@pytest.mark.parametrize("fn", [lambda: len(bytearray(1 << 30)), lambda: len(b"x" * (1 << 30)), _grow_list])
def test_allocating_a_gigabyte_is_out_of_bounds_and_spares_the_parent(fn: Callable[[], Any]) -> None:
    before = peak_rss()
    seen, on_stats = _stats()
    with pytest.raises(OutOfBounds, match="exceeded its memory bound of 256 MiB") as info:
        run_bounded(fn, memory=MEMORY, timeout=30, on_stats=on_stats)
    assert info.value.reason == "memory" and is_permanent(info.value)
    assert peak_rss() - before < 50 * MiB
    assert seen[0].maxrss < peak_rss() + MEMORY + 32 * MiB  # the child stayed within its bound


def test_bound_is_growth_over_what_the_child_had_at_fork() -> None:
    ballast = bytearray(512 * MiB)  # address space of the parent (never touched: no RSS)
    try:
        assert run_bounded(lambda: len(bytearray(96 * MiB)), memory=128 * MiB, timeout=10) == 96 * MiB
        # Well past the bound: heap the parent freed but kept (earlier tests) is reusable
        # by the child without counting as growth, so a figure just over it may pass.
        with pytest.raises(OutOfBounds):
            run_bounded(lambda: len(bytearray(400 * MiB)), memory=128 * MiB, timeout=10)
    finally:
        del ballast


def _map_file(path: str) -> int:
    with open(path, "rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as view:
        return len(view) + view[len(view) // 2]


def test_mapping_a_file_does_not_count(tmp_path: Path) -> None:
    """Why RLIMIT_DATA and not RLIMIT_AS: a read-only file mapping is page cache, not the
    child's memory. RLIMIT_AS (= VmSize + 128 MiB) refuses this 512 MiB mapping;
    RLIMIT_DATA counts only the heap and private writable mappings (which the gigabyte
    and lxml tests above show it does bound, mmap-backed malloc included)."""
    sparse = tmp_path / "sparse"
    with sparse.open("wb") as file:
        file.truncate(512 * MiB)
    assert run_bounded(_map_file, str(sparse), memory=128 * MiB, timeout=10) == 512 * MiB


def _parse_xml(elements: int) -> int:
    import lxml.etree as etree

    data = b"<r>" + b"<a x='1'>hello world</a>" * elements + b"</r>"
    return len(etree.fromstring(data))


def test_lxml_parsing_a_huge_document_is_out_of_bounds() -> None:
    assert run_bounded(_parse_xml, 10_000, memory=MEMORY, timeout=30) == 10_000
    before = peak_rss()
    with pytest.raises(OutOfBounds) as info:  # 72 MB of XML whose tree needs ~1.5 GB
        run_bounded(_parse_xml, 3_000_000, memory=MEMORY, timeout=30)
    assert info.value.reason == "memory"
    assert peak_rss() - before < 50 * MiB


def _segfault() -> None:
    faulthandler.disable()  # pytest enabled it; keep its dump out of the test output
    ctypes.string_at(0)


def test_a_child_dying_by_segfault_counts_as_memory() -> None:
    with pytest.raises(OutOfBounds) as info:
        run_bounded(_segfault, memory=MEMORY, timeout=10)
    assert info.value.reason == "memory"


# --- time ------------------------------------------------------------------------------


def _spin() -> None:
    while True:
        pass


@pytest.mark.parametrize(
    ("fn", "args"),
    [(_spin, ()), (time.sleep, (100,)), (re.fullmatch, (r"(a+)+b", "a" * 64))],  # the last loops in C
    ids=["python-loop", "sleep", "regex-in-C"],
)
def test_time_bound_kills_and_reaps_the_child(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    seen, on_stats = _stats()
    started = time.monotonic()
    with pytest.raises(OutOfBounds, match="did not finish within 1 s") as info:
        run_bounded(fn, *args, memory=MEMORY, timeout=1, on_stats=on_stats)
    assert time.monotonic() - started < 2
    assert info.value.reason == "time"
    with pytest.raises(ChildProcessError):
        os.waitpid(seen[0].pid, os.WNOHANG)  # already reaped: no zombie
    assert not Path(f"/proc/{seen[0].pid}").exists()


@pytest.mark.parametrize("interrupt", [SoftTimeLimitExceeded, KeyboardInterrupt])
def test_an_interrupted_wait_kills_and_reaps_the_child(
    tmp_path: Path, interrupt: type[BaseException]
) -> None:
    pidfile = tmp_path / "pid"

    def sleeper() -> None:
        pidfile.write_text(str(os.getpid()))
        time.sleep(60)

    def on_alarm(signum: int, frame: object) -> None:
        raise interrupt()

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    started = time.monotonic()
    try:
        with pytest.raises(interrupt):
            run_bounded(sleeper, memory=MEMORY, timeout=30)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert time.monotonic() - started < 2
    pid = int(pidfile.read_text())
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert not Path(f"/proc/{pid}").exists()


def test_the_child_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """A pool process SIGKILLed at its hard time limit leaves no orphan behind."""
    pidfile = tmp_path / "pid"

    def sleeper() -> None:
        pidfile.write_text(str(os.getpid()))
        time.sleep(60)

    worker = os.fork()
    if worker == 0:  # pragma: no cover - the stand-in worker process
        try:
            run_bounded(sleeper, memory=MEMORY, timeout=60)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    os.kill(worker, signal.SIGKILL)
    os.waitpid(worker, 0)
    child = int(pidfile.read_text())
    while not _gone_or_zombie(child):
        assert time.monotonic() < deadline, "the bounded child outlived its parent"
        time.sleep(0.01)


# --- errors ----------------------------------------------------------------------------


def _raise(exc: BaseException) -> None:
    raise exc


def test_a_conveyor_error_comes_back_as_the_same_class() -> None:
    with pytest.raises(DocumentBroken) as info:
        run_bounded(_raise, DocumentBroken("page 3 is broken"), memory=MEMORY, timeout=10)
    assert type(info.value) is DocumentBroken and str(info.value) == "page 3 is broken"
    assert "in the isolated child" in info.value.__notes__[0]


def test_an_unimportable_conveyor_error_falls_back_to_its_importable_base() -> None:
    class Local(TransientError):
        pass

    with pytest.raises(TransientError, match="try again") as info:
        run_bounded(_raise, Local("try again"), memory=MEMORY, timeout=10)
    assert type(info.value) is TransientError  # still retried, as the original would be


def test_any_other_exception_is_a_permanent_child_failure() -> None:
    with pytest.raises(ChildFailed, match="ValueError: bad input") as info:
        run_bounded(_raise, ValueError("bad input"), memory=MEMORY, timeout=10)
    assert info.value.type_name == "builtins.ValueError" and info.value.detail == "bad input"
    assert is_permanent(info.value)
    assert "_raise" in info.value.__notes__[0]


@pytest.mark.parametrize(
    ("fn", "match"),
    [(lambda: os.kill(os.getpid(), signal.SIGUSR1), "killed by SIGUSR1"), (lambda: os._exit(3), "status 3")],
)
def test_a_child_that_dies_oddly_is_a_child_failure(fn: Callable[[], Any], match: str) -> None:
    with pytest.raises(ChildFailed, match=match):
        run_bounded(fn, memory=MEMORY, timeout=10)


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        run_bounded(len, "x", memory=0, timeout=1)


# --- the child is not the parent -------------------------------------------------------

_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGALRM)
# Termination signals are the parent's to act on (a Ctrl-C or a systemd stop reaches the
# whole process group/cgroup); every handler the parent installed is gone.
_EXPECTED = {"SIGTERM": "ignored", "SIGINT": "ignored", "SIGUSR1": "default", "SIGALRM": "default"}


def _dispositions() -> dict[str, str]:
    names = {signal.SIG_DFL: "default", signal.SIG_IGN: "ignored"}
    return {signal.Signals(s).name: names.get(signal.getsignal(s), "handler") for s in _SIGNALS}  # type: ignore[call-overload]


def _signal_self(sig: int) -> str:
    os.kill(os.getpid(), sig)
    return "alive"


def _sleep_then(seconds: float, value: str) -> str:
    time.sleep(seconds)
    return value


def test_the_child_resets_handlers_and_skips_atexit_and_stdio(tmp_path: Path) -> None:
    handled, at_exit = tmp_path / "handled", tmp_path / "atexit"

    def handler(signum: int, frame: object) -> None:
        handled.write_text(str(os.getpid()))

    def on_exit() -> None:
        at_exit.write_text(str(os.getpid()))

    previous = {s: signal.signal(s, handler) for s in _SIGNALS}
    atexit.register(on_exit)
    buffered = (tmp_path / "buffered").open("w")
    buffered.write("once\n")  # sits in the parent's buffer while the child exits
    try:
        assert run_bounded(_dispositions, memory=MEMORY, timeout=10) == _EXPECTED
        for sig in _SIGNALS[:2]:  # the parent's handler does not run, nor does the child die
            assert run_bounded(_signal_self, sig, memory=MEMORY, timeout=10) == "alive"
    finally:
        buffered.close()
        atexit.unregister(on_exit)
        for sig, old in previous.items():
            signal.signal(sig, old)
    assert not handled.exists() and not at_exit.exists()
    assert (tmp_path / "buffered").read_text() == "once\n"


def test_works_from_threads_concurrently() -> None:
    results: dict[str, Any] = {}

    def call(name: str, fn: Callable[..., Any], *args: Any) -> None:
        started = time.monotonic()
        results[name] = (run_bounded(fn, *args, memory=MEMORY, timeout=10), time.monotonic() - started)

    slow = threading.Thread(target=call, args=("slow", _sleep_then, 1.5, "slow"))
    slow.start()
    time.sleep(0.1)
    quick = [threading.Thread(target=call, args=(f"q{i}", _dispositions)) for i in range(4)]
    for thread in quick:
        thread.start()
    for thread in [slow, *quick]:
        thread.join()
    assert results["slow"][0] == "slow"
    for i in range(4):
        assert results[f"q{i}"][0] == _EXPECTED
        assert results[f"q{i}"][1] < 1  # not held up by the slow sibling


def test_a_leftover_copy_of_the_pipe_does_not_hold_the_parent() -> None:
    """The result is complete once the child is reaped: no wait for EOF, which a process
    forked meanwhile (here a grandchild) can delay by holding the pipe's write end."""

    def fork_a_sleeper() -> int:
        pid = os.fork()
        if pid == 0:
            time.sleep(5)
            os._exit(0)
        return pid

    started = time.monotonic()
    grandchild = run_bounded(fork_a_sleeper, memory=MEMORY, timeout=10)
    try:
        assert time.monotonic() - started < 1
    finally:
        os.kill(grandchild, signal.SIGKILL)


def test_stats_and_peak_rss() -> None:
    seen, on_stats = _stats()
    touched = run_bounded(lambda: len(b"x" * (64 * MiB)), memory=MEMORY, timeout=10, on_stats=on_stats)
    assert touched == 64 * MiB
    (stats,) = seen
    assert stats.pid != os.getpid() and stats.maxrss >= 64 * MiB
    assert 0 < stats.wall < 5 and stats.cpu >= 0
    assert peak_rss() >= peak_rss(os.getpid()) > 0
