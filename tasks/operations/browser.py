"""The per-process pool of headless Chromium browsers the operations stages drive.

Debian's ``chromium`` through its own ``chromedriver`` (Selenium 4; the driver's path is always
given, so Selenium Manager never runs and nothing is downloaded). Each browser has its own
profile ``<home>/browsers/<pid>-<n>`` (``--user-data-dir``) and downloads directory, so the
browsers of a host can be counted and an orphan found by its command line.

A browser goes back to the pool after its lease ends in success, an ordinary failure, a
cancel or a preemption; after a soft time limit, a keyboard interrupt, a driver error, or an
exception raised while a driver call was under way (a signal landing inside one), the driver's
state is unknown: the browser is killed with its process tree, its profile removed, and a new
one is started at the next lease. A pool used in a forked child builds its own browsers.

A SIGKILLed worker cannot quit its browsers: chromedriver gets ``PR_SET_PDEATHSIG`` (SIGKILL),
but the Chromium under it does not, hence :func:`sweep_orphans` at start-up.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from billiard.exceptions import SoftTimeLimitExceeded
from selenium import webdriver
from selenium.common.exceptions import WebDriverException
from selenium.webdriver.chrome.service import Service

from conveyor.errors import TransientError

__all__ = ["Browser", "BrowserPool", "sweep_orphans", "wait_download"]

_PR_SET_PDEATHSIG = 1
_OWNER_FILE = ".conveyor-owner"
# Modules whose frames in a traceback mean the exception interrupted a call to the driver.
_DRIVER_MODULES = ("selenium.", "urllib3.", "http.client", "socket")
_numbers = itertools.count(1)
_libc = ctypes.CDLL(None, use_errno=True)
_Jobs = queue.SimpleQueue[tuple[Callable[[], "Browser"], "queue.SimpleQueue[Browser | BaseException]"]]


def _die_with_parent() -> None:
    # Runs in the forked chromedriver before exec: a SIGKILLed worker takes its driver along.
    # The signal follows the *thread* that forked, hence the pool's spawner thread.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


@dataclass(eq=False)
class Browser:
    """One leased browser: the Selenium ``driver``, its ``profile`` (user data) directory and
    the ``downloads`` directory its downloads land in."""

    driver: webdriver.Chrome
    profile: Path
    downloads: Path
    service: Service = field(repr=False)
    # Downloads already handed out by wait_download during this lease.
    taken: set[str] = field(default_factory=set, repr=False)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with suppress(OSError, IndexError, ValueError):
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            tree.setdefault(ppid, []).append(int(entry.name))
    return tree


def _kill_tree(root: int) -> list[int]:
    """SIGKILL ``root`` and every descendant (collected first: orphans get reparented)."""
    tree, todo, found = _children(), [root], []
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(tree.get(pid, []))
    for pid in found:
        with suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    return found


def _wait_gone(pids: list[int], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(_start_time(p) is not None for p in pids) and time.monotonic() < deadline:
        time.sleep(0.02)


def _cmdline(pid: str) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def _owner_alive(profile: Path) -> bool:
    """Whether the process that made ``profile`` (``<pid>-<n>``) still runs; the owner file's
    start time tells a reused pid from the owner."""
    try:
        pid = int(profile.name.split("-", 1)[0])
    except ValueError:
        return True  # not one of ours: leave it alone
    started = _start_time(pid)
    if started is None:
        return False
    try:
        host, _, recorded = (profile / _OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return True
    return host != socket.gethostname() or recorded == started


def sweep_orphans(home: Path) -> int:
    """SIGKILL the Chromium processes (and their descendants) whose ``--user-data-dir`` is a
    profile under ``home/browsers/`` of a process that no longer runs, and remove such
    profiles (also those no process uses any more); returns how many processes matched."""
    root = Path(home) / "browsers"
    prefix = f"--user-data-dir={root}/"
    killed: list[int] = []
    dead: set[Path] = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        for arg in _cmdline(entry.name):
            if arg.startswith(prefix):
                profile = root / arg[len(prefix) :].split("/", 1)[0]
                if not _owner_alive(profile):
                    dead.add(profile)
                    killed.append(int(entry.name))
                    _kill_tree(int(entry.name))
                break
    _wait_gone(killed)
    if root.is_dir():
        dead.update(p for p in root.iterdir() if p.is_dir() and not _owner_alive(p))
    for profile in dead:
        shutil.rmtree(profile, ignore_errors=True)
    return len(killed)


def wait_download(browser: Browser, timeout: float) -> Path:
    """Wait up to ``timeout`` seconds for the single new file in ``browser.downloads`` (one
    this lease's earlier calls did not return) whose download has finished (no
    ``.crdownload`` left); TransientError when none or several."""
    deadline = time.monotonic() + timeout
    while True:
        # Chromium stages a download in a hidden temporary file first.
        names = [p for p in browser.downloads.iterdir() if p.name[0] != "." and p.name not in browser.taken]
        partial = [p for p in names if p.suffix == ".crdownload"]
        done = [p for p in names if p.suffix != ".crdownload"]
        if len(done) > 1:
            raise TransientError(f"{len(done)} downloads in {browser.downloads}, expected one")
        if len(done) == 1 and not partial:
            browser.taken.add(done[0].name)
            return done[0]
        if time.monotonic() >= deadline:
            raise TransientError(f"no download finished within {timeout:g} s")
        time.sleep(0.05)


def _in_driver_call(tb: TracebackType | None) -> bool:
    while tb is not None:
        module = str(tb.tb_frame.f_globals.get("__name__", ""))
        if module.startswith(_DRIVER_MODULES):
            return True
        tb = tb.tb_next
    return False


def _state_unknown(exc: BaseException | None) -> bool:
    """Whether a browser whose lease ended with ``exc`` (or an exception it was raised from or
    while handling) must be replaced rather than reused."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if not isinstance(exc, Exception) or isinstance(exc, SoftTimeLimitExceeded | WebDriverException):
            return True
        if _in_driver_call(exc.__traceback__):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class _Slots:
    """One process's browsers: idle ones, and how many exist (idle, leased or starting)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.changed = threading.Condition()
        self.idle: list[Browser] = []
        self.count = 0


class BrowserPool:
    """At most ``size`` headless Chromium browsers per process, leased one caller at a time
    (:meth:`lease`); profiles under ``home/browsers/``; ``page_timeout`` seconds for page loads
    and scripts (see the module docs)."""

    def __init__(
        self,
        home: Path,
        *,
        chromium: str = "/usr/bin/chromium",
        chromedriver: str = "/usr/bin/chromedriver",
        size: int = 1,
        page_timeout: float = 30.0,
    ) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.home = Path(home)
        self.chromium = chromium
        self.chromedriver = chromedriver
        self.size = size
        self.page_timeout = page_timeout
        self._slots = _Slots()
        self._spawner_lock = threading.Lock()
        self._spawner: threading.Thread | None = None
        self._jobs: _Jobs = queue.SimpleQueue()

    def _mine(self) -> _Slots:
        # After a fork the parent's browsers are not ours to use or quit (nor its lock).
        if self._slots.pid != os.getpid():
            self._slots = _Slots()
            self._spawner_lock = threading.Lock()
            self._spawner = None
            self._jobs = queue.SimpleQueue()
        return self._slots

    @contextmanager
    def lease(self, timeout: float | None = None) -> Iterator[Browser]:
        """A browser of this process's pool for the ``with`` body, waiting up to ``timeout``
        seconds (default ``page_timeout``) for one to be free (TransientError past it); see
        the module docs for when it is returned and when replaced."""
        slots = self._mine()
        wait = self.page_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        with slots.changed:
            while not slots.idle and slots.count >= self.size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransientError(f"no browser free within {wait:g} s ({self.size} per process)")
                slots.changed.wait(left)
            browser = slots.idle.pop() if slots.idle else None
            if browser is None:
                slots.count += 1
        if browser is None:
            try:
                browser = self._start()
            except BaseException:
                with slots.changed:
                    slots.count -= 1
                    slots.changed.notify()
                raise
        keep = False
        try:
            _clear(browser)
            yield browser
            keep = True
        except BaseException as exc:
            keep = not _state_unknown(exc)
            raise
        finally:
            if not keep:
                _destroy(browser)
            with slots.changed:
                if keep:
                    slots.idle.append(browser)
                else:
                    slots.count -= 1
                slots.changed.notify()

    def close(self) -> None:
        """Kill every idle browser of this process (leased ones end with their lease)."""
        slots = self._mine()
        with slots.changed:
            idle, slots.idle = slots.idle, []
            slots.count -= len(idle)
            slots.changed.notify_all()
        for browser in idle:
            _destroy(browser)

    def _start(self) -> Browser:
        # Started from one long-lived thread: PR_SET_PDEATHSIG fires when the thread that
        # forked chromedriver exits, and a leasing thread may be short-lived.
        with self._spawner_lock:
            if self._spawner is None or not self._spawner.is_alive():
                self._spawner = threading.Thread(
                    target=_spawner_loop, args=(self._jobs,), name="conveyor-browsers", daemon=True
                )
                self._spawner.start()
        answer: queue.SimpleQueue[Browser | BaseException] = queue.SimpleQueue()
        self._jobs.put((self._launch, answer))
        outcome = answer.get()
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    def _launch(self) -> Browser:
        profile = self.home / "browsers" / f"{os.getpid()}-{next(_numbers)}"
        shutil.rmtree(profile, ignore_errors=True)
        downloads = profile / "downloads"
        downloads.mkdir(parents=True)
        (profile / _OWNER_FILE).write_text(
            f"{socket.gethostname()} {os.getpid()} {_start_time(os.getpid())}\n"
        )
        options = webdriver.ChromeOptions()
        options.binary_location = self.chromium
        for arg in (
            "--headless=new",
            "--disable-dev-shm-usage",
            "--disable-gpu",
            "--no-first-run",
            "--no-default-browser-check",
            # Nothing fetched behind the stage's back (component updates, variations, sync).
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--password-store=basic",
            f"--user-data-dir={profile}",
        ):
            options.add_argument(arg)
        if os.geteuid() == 0:
            options.add_argument("--no-sandbox")
        options.add_experimental_option(
            "prefs",
            {
                "download.default_directory": str(downloads),
                "download.prompt_for_download": False,
                "download.directory_upgrade": True,
                "plugins.always_open_pdf_externally": True,
                "safebrowsing.enabled": False,
            },
        )
        service = Service(self.chromedriver, popen_kw={"preexec_fn": _die_with_parent})
        # SE_CHROMEDRIVER in the environment would otherwise win over the configured path.
        service.path = self.chromedriver
        try:
            driver = webdriver.Chrome(service=service, options=options)
        except BaseException:
            process = getattr(service, "process", None)
            if process is not None:
                _wait_gone(_kill_tree(process.pid))
            shutil.rmtree(profile, ignore_errors=True)
            raise
        driver.set_page_load_timeout(self.page_timeout)
        driver.set_script_timeout(self.page_timeout)
        return Browser(driver=driver, profile=profile, downloads=downloads, service=service)


def _spawner_loop(jobs: _Jobs) -> None:
    while True:
        launch, answer = jobs.get()
        try:
            answer.put(launch())
        except BaseException as exc:
            answer.put(exc)


def _clear(browser: Browser) -> None:
    """Empty the downloads of a browser an earlier lease used."""
    browser.taken.clear()
    for path in browser.downloads.iterdir():
        with suppress(OSError):
            path.unlink()


def _destroy(browser: Browser) -> None:
    """Kill chromedriver and the Chromium under it (no graceful quit: the driver may hang),
    then remove the profile."""
    process = browser.service.process
    pids = _kill_tree(process.pid)
    with suppress(OSError, subprocess.TimeoutExpired):
        process.wait(5)
    _wait_gone(pids)
    shutil.rmtree(browser.profile, ignore_errors=True)
