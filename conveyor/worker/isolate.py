"""Run a pure function in a forked child whose memory and time are bounded.

A C-level parser (lxml, zlib, pypdf) fed a hostile document can allocate gigabytes or loop
inside C, where a Celery soft time limit cannot interrupt it. :func:`run_bounded` runs it
in a child process instead.

**Memory**: the child may grow by ``memory`` bytes over what it had at fork time:
``RLIMIT_DATA`` = its ``VmData`` + ``memory``. Since Linux 4.7 that counts the heap and
every private writable mapping, i.e. all that glibc malloc (brk *and* mmap), obmalloc and
libxml2 allocate, but not read-only file mappings, shared libraries or reservations
(64 MiB ``PROT_NONE`` per glibc thread arena), which ``RLIMIT_AS`` would count. A failed allocation
(``MemoryError``, lxml's ``ERR_NO_MEMORY``) or a death by SIGSEGV/SIGBUS/SIGABRT/SIGKILL
(unchecked malloc, C stack overflow, the OOM killer) is ``OutOfBounds(reason="memory")``.
**Time**: at ``timeout`` seconds the child is SIGKILLed: ``OutOfBounds(reason="time")``.

Fork caveat: in a multi-threaded parent only the forking thread exists in the child, and
locks other threads held stay held. Python re-initialises its own (GIL, import lock,
logging), not those of C libraries or other code: ``fn`` must be a pure computation on its
arguments (no logging, I/O, DB or broker use). The child does nothing else: it fixes its
signal dispositions, sets its limit, runs ``fn``, writes the pipe and leaves by
``os._exit`` (no atexit handlers, no stdio flush; inherited sockets are never touched).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import importlib
import json
import os
import resource
import select
import signal
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar, cast

from conveyor.errors import ChildFailed, ConveyorError, OutOfBounds

T = TypeVar("T")

_CHUNK = 1 << 20
# The parent alone ends the child (SIGKILL at the deadline, on an interrupted wait, at its
# own death): termination signals sent to a process group or cgroup (Ctrl-C, systemd
# stopping the worker) are ignored, so the job stops as a shutdown instead of failing.
_IGNORE = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_DEFAULT = (signal.SIGALRM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD)
_MEMORY_SIGNALS = (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT, signal.SIGKILL)
_FAILED_EXIT = 70  # the child could not even report its failure
_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)

# Python 3.12+ warns on fork() in a multi-threaded process; the caveat is documented above.
_FORK_WARNING = r".*use of fork\(\) may lead to deadlocks"
warnings.filterwarnings("ignore", _FORK_WARNING, DeprecationWarning, __name__.replace(".", r"\."))


@dataclass(frozen=True)
class ChildStats:
    """What one child cost, from ``os.wait4``. ``maxrss`` (bytes) is its peak resident set,
    which includes the pages it shared with the parent at fork time."""

    pid: int
    maxrss: int
    cpu: float  # user + system seconds
    wall: float  # seconds from fork to reaping


def peak_rss(pid: int | None = None) -> int:
    """Peak resident set size (``VmHWM``) of ``pid`` (default: this process), in bytes."""
    return _status_bytes("VmHWM", "self" if pid is None else str(pid))


def run_bounded(
    fn: Callable[..., T],
    *args: Any,
    memory: int,
    timeout: float,
    on_stats: Callable[[ChildStats], None] | None = None,
    **kwargs: Any,
) -> T:
    """Return ``fn(*args, **kwargs)`` computed in a forked child bounded by ``memory`` bytes
    of growth and ``timeout`` seconds. Safe to call from any thread.

    ``fn`` and its arguments need no pickling (the child is a fork). The result must be a
    ``str`` (streamed back as UTF-8 in chunks while the parent reads) or JSON-serializable
    (tuples come back as lists); serialising it is outside the memory bound. ``on_stats``
    gets the child's :class:`ChildStats` once it is reaped (not on an interrupted wait).

    A :class:`ConveyorError` raised by ``fn`` is re-raised as the same class (else as its
    nearest importable ConveyorError base, so the retry policy holds) with its message;
    any other exception is :class:`ChildFailed`; the child's traceback is attached as a
    note. Bounds exceeded: :class:`OutOfBounds`. If the wait is interrupted by any
    exception (``SoftTimeLimitExceeded``, ``KeyboardInterrupt``), the child is killed and
    reaped before it propagates.
    """
    if memory <= 0 or timeout <= 0:
        raise ValueError("memory and timeout must be positive")
    rfd, wfd = os.pipe()
    with contextlib.suppress(OSError):  # fewer wakeups for long strings; best effort
        fcntl.fcntl(wfd, fcntl.F_SETPIPE_SZ, _CHUNK)
    started, parent = time.monotonic(), os.getpid()
    try:
        pid = os.fork()
    except BaseException:
        os.close(rfd)
        os.close(wfd)
        raise
    if pid == 0:  # pragma: no cover - the child; coverage cannot see it
        _child(wfd, rfd, parent, memory, functools.partial(fn, *args, **kwargs))
    outcome = None
    try:
        os.close(wfd)
        outcome = _collect(pid, rfd, started + timeout)
    finally:
        os.close(rfd)
        if outcome is None:  # the deadline passed, or an exception interrupted the wait
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _, status, usage = os.wait4(pid, 0)  # SIGCHLD must not be ignored (SIG_IGN)
    if outcome is not None:
        chunks, status, usage = outcome
    if on_stats is not None:
        cpu = usage.ru_utime + usage.ru_stime
        on_stats(ChildStats(pid, usage.ru_maxrss * 1024, cpu, time.monotonic() - started))
    if outcome is None:
        raise OutOfBounds("time", timeout)
    return cast(T, _decode(chunks, status, memory))


def _child(wfd: int, rfd: int, parent: int, memory: int, call: Callable[[], Any]) -> NoReturn:
    """The child's whole life; it never returns into the caller's code."""
    code = _FAILED_EXIT
    try:
        # Die with the parent: a pool process SIGKILLed at its hard time limit must not
        # leave an orphan looping in C. (Checked after: the parent may already be gone.)
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:
            os._exit(code)
        os.close(rfd)
        for sig in _IGNORE:
            signal.signal(sig, signal.SIG_IGN)
        for sig in _DEFAULT:
            signal.signal(sig, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)  # the parent's event loop must not hear the child's signals
        soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
        bound = _status_bytes("VmData", "self") + memory
        resource.setrlimit(
            resource.RLIMIT_DATA, (bound if hard == resource.RLIM_INFINITY else min(bound, hard), hard)
        )
        try:
            result = call()
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
            tag, body = (b"S", result) if isinstance(result, str) else (b"J", json.dumps(result))
        except BaseException as exc:
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
            kind = type(exc)
            error = {
                "type": f"{kind.__module__}.{kind.__qualname__}",
                "message": str(exc),
                "memory": _out_of_memory(exc),
                "classes": [
                    [c.__module__, c.__qualname__] for c in kind.__mro__ if issubclass(c, ConveyorError)
                ],
                "traceback": "".join(traceback.format_exception(exc))[-8000:],
            }
            tag, body = b"E", json.dumps(error)
        _write(wfd, tag)
        for start in range(0, len(body), _CHUNK):
            _write(wfd, body[start : start + _CHUNK].encode("utf-8", "surrogatepass"))
        code = 0
    finally:
        os._exit(code)


def _out_of_memory(exc: BaseException | None) -> bool:
    """A failed allocation anywhere in the exception chain: ``MemoryError``, ``ENOMEM`` (mmap),
    or libxml2's, which lxml raises as an error with code 2 (``XML_ERR_NO_MEMORY``)."""
    seen = 0
    while exc is not None and seen < 20:
        if isinstance(exc, MemoryError) or (isinstance(exc, OSError) and exc.errno == errno.ENOMEM):
            return True
        if type(exc).__module__.startswith("lxml.") and getattr(exc, "code", None) == 2:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def _collect(pid: int, rfd: int, deadline: float) -> tuple[list[bytes], int, Any] | None:
    """Read the child's message while it runs; return it with the child's exit status and
    rusage once reaped, or None at the deadline."""
    chunks: list[bytes] = []
    os.set_blocking(rfd, False)
    poller = select.poll()
    poller.register(rfd, select.POLLIN)
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):  # Linux >= 5.3; else poll every 50 ms
        pidfd = os.pidfd_open(pid)
        poller.register(pidfd, select.POLLIN)
    try:
        while True:
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                # Everything it wrote is in the pipe now. No EOF wait: a sibling child forked
                # by another thread meanwhile may hold a copy of the write end.
                _drain(rfd, chunks)
                return chunks, status, usage
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            step = remaining if pidfd is not None else min(remaining, 0.05)
            for fd, _ in poller.poll(step * 1000):
                if fd == rfd and not _drain(rfd, chunks):
                    poller.unregister(rfd)  # EOF
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _drain(fd: int, chunks: list[bytes]) -> bool:
    """Read what is available; False at end of file."""
    while True:
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return True
        if not data:
            return False
        chunks.append(data)


def _decode(chunks: list[bytes], status: int, memory: int) -> Any:
    code = os.waitstatus_to_exitcode(status)
    if -code in _MEMORY_SIGNALS:
        raise OutOfBounds("memory", memory)
    if code < 0:
        raise ChildFailed("signal", f"the child was killed by {signal.Signals(-code).name}")
    if code != 0 or not chunks:
        raise ChildFailed("exit", f"the child exited with status {code} without a result")
    tag, chunks[0] = chunks[0][:1], chunks[0][1:]
    data = b"".join(chunks)
    if tag == b"S":
        return data.decode("utf-8", "surrogatepass")
    if tag == b"J":
        return json.loads(data)
    raise _rebuild(json.loads(data), memory)


def _rebuild(info: dict[str, Any], memory: int) -> Exception:
    """The parent's copy of the child's exception."""
    if info["memory"]:
        exc: Exception = OutOfBounds("memory", memory)
    else:
        exc = ChildFailed(info["type"], info["message"])
        for module, qualname in info["classes"]:
            try:
                found: Any = importlib.import_module(module)
                for part in qualname.split("."):
                    found = getattr(found, part)
                if isinstance(found, type) and issubclass(found, ConveyorError):
                    exc = found(info["message"])
                    break
            except Exception:
                continue  # not importable (a local class) or another constructor: try its base
    exc.add_note("in the isolated child:\n" + info["traceback"])
    return exc


def _status_bytes(key: str, pid: str) -> int:
    with open(f"/proc/{pid}/status", "rb") as status:
        for line in status:
            if line.startswith(key.encode() + b":"):
                return int(line.split()[1]) * 1024
    raise LookupError(f"{key} not in /proc/{pid}/status")


def _write(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
