"""The operations family's browser pool (``tasks.operations.browser``) with Debian's real
``chromium`` and ``chromedriver`` against the local ERP peer: reuse, replacement after a driver
error, the per-process bound, a download, a forked child's own pool, and the orphan sweep after
a SIGKILLed owner."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("selenium")

from billiard.exceptions import SoftTimeLimitExceeded
from selenium.common.exceptions import NoSuchElementException
from selenium.webdriver.common.by import By
from selenium.webdriver.common.selenium_manager import SeleniumManager
from selenium.webdriver.support.wait import WebDriverWait

from conveyor.errors import Preempted, TransientError
from pipelines.operations.peers.erp import ErpPeer
from tasks.operations.browser import Browser, BrowserPool, sweep_orphans, wait_download

pytestmark = pytest.mark.timeout(60)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[2]


def using(profile: Path) -> list[int]:
    """Live (not zombie) processes whose command line names ``profile`` as their user data."""
    flag = f"--user-data-dir={profile}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if flag in args and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def gone(pids: list[int], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


@pytest.fixture(scope="module")
def peer(request: pytest.FixtureRequest) -> Iterator[ErpPeer]:
    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        missing = "chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        if request.config.getoption("--require-services"):
            pytest.fail(missing)
        pytest.skip(missing)
    with ErpPeer(customers=30, orders=5, products=5) as erp:
        yield erp


@pytest.fixture
def pool(tmp_path: Path, peer: ErpPeer, monkeypatch: pytest.MonkeyPatch) -> Iterator[BrowserPool]:
    """A pool of one browser under ``tmp_path``; Selenium Manager (which downloads) must never run."""

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("Selenium Manager ran")

    monkeypatch.setattr(SeleniumManager, "binary_paths", refused)
    pool = BrowserPool(tmp_path, chromium=CHROMIUM, chromedriver=CHROMEDRIVER, page_timeout=20)
    yield pool
    pool.close()
    assert not using(tmp_path / "browsers"), "a browser outlived its pool"
    leftovers = [p for p in (tmp_path / "browsers").iterdir()] if (tmp_path / "browsers").exists() else []
    assert leftovers == [], "a closed pool left profiles behind"


def log_in(browser: Browser, peer: ErpPeer, page: str = "/customers") -> None:
    driver = browser.driver
    driver.get(f"{peer.url}/login?next={page}")
    driver.find_element(By.ID, "login").send_keys("alice")
    driver.find_element(By.ID, "password").send_keys("erp-pass")
    driver.find_element(By.ID, "submit").click()
    # The click returns before the redirected page has loaded.
    WebDriverWait(driver, 10).until(lambda d: d.find_elements(By.ID, "export-pdf"))


def test_a_browser_is_reused_after_success_an_ordinary_failure_and_a_preemption(
    pool: BrowserPool, peer: ErpPeer
) -> None:
    with pool.lease() as browser:
        log_in(browser, peer)
        first = (browser.profile, browser.driver.session_id)
        assert browser.profile.parent == pool.home / "browsers"
        assert browser.profile.name.startswith(f"{os.getpid()}-")
        assert browser.downloads.is_dir() and browser.downloads.parent == browser.profile
    for failure in (ValueError("bad record"), Preempted("a write needs the lease")):
        with pytest.raises(type(failure)), pool.lease() as browser:
            assert (browser.profile, browser.driver.session_id) == first
            raise failure
    with pool.lease() as browser:
        assert (browser.profile, browser.driver.session_id) == first
        browser.driver.get(f"{peer.url}/orders")  # still logged in: the same session and cookies
        assert browser.driver.find_elements(By.ID, "export-pdf")


@pytest.mark.parametrize("ending", ["driver error", "soft time limit", "interrupt in a driver call"])
def test_a_browser_in_an_unknown_state_is_killed_and_replaced(
    pool: BrowserPool, peer: ErpPeer, ending: str
) -> None:
    ended = (NoSuchElementException, SoftTimeLimitExceeded, Preempted)
    with pytest.raises(ended), pool.lease() as browser:
        browser.driver.get(f"{peer.url}/login")
        old = browser.profile
        processes = using(old)
        assert processes, "no Chromium runs with the leased profile"
        if ending == "driver error":
            browser.driver.find_element(By.ID, "no-such-element")
        if ending == "interrupt in a driver call":
            # As the heartbeat's SIGUSR2 does: Preempted raised while the driver answers.
            interrupt(after=0.3)
            browser.driver.execute_async_script("setTimeout(arguments[0], 5000)")
        raise SoftTimeLimitExceeded()
    assert gone(processes), f"the replaced browser's processes live on: {processes}"
    assert not old.exists()
    with pool.lease() as browser:
        assert browser.profile != old
        browser.driver.get(f"{peer.url}/login")
        assert browser.driver.find_elements(By.ID, "login")


def interrupt(after: float) -> None:
    def raise_preempted(signum: int, frame: object) -> None:
        signal.signal(signal.SIGUSR2, previous)
        raise Preempted("interrupted: it did not yield its lease in time")

    previous = signal.signal(signal.SIGUSR2, raise_preempted)
    threading.Timer(after, os.kill, (os.getpid(), signal.SIGUSR2)).start()


def test_a_second_lease_waits_for_the_only_browser_and_times_out_as_transient(
    pool: BrowserPool, peer: ErpPeer
) -> None:
    with pool.lease() as browser:
        held = browser.profile
        started = time.monotonic()
        with pytest.raises(TransientError, match="no browser free"), pool.lease(timeout=0.5):
            pass
        assert 0.4 < time.monotonic() - started < 5
    # A lease waiting in another thread gets the browser the moment it is returned.
    got: list[Path] = []
    with pool.lease() as browser:
        waiter = threading.Thread(target=lambda: got.append(lease_profile(pool)))
        waiter.start()
        time.sleep(0.3)
        assert not got
    waiter.join(10)
    assert got == [held]
    assert len(list((pool.home / "browsers").iterdir())) == 1


def lease_profile(pool: BrowserPool) -> Path:
    with pool.lease(timeout=10) as browser:
        browser.driver.get("about:blank")
        return browser.profile


def test_an_export_downloaded_through_the_browser_lands_in_its_downloads(
    pool: BrowserPool, peer: ErpPeer
) -> None:
    with pool.lease() as browser:
        log_in(browser, peer)
        browser.driver.find_element(By.ID, "export-pdf").click()
        pdf = wait_download(browser, timeout=20)
        assert pdf.parent == browser.downloads
        assert pdf.read_bytes().startswith(b"%PDF")
        assert not list(browser.downloads.glob("*.crdownload"))
        browser.driver.get(f"{peer.url}/products")
        WebDriverWait(browser.driver, 10).until(lambda d: d.find_elements(By.ID, "export-pdf"))
        browser.driver.find_element(By.ID, "export-pdf").click()
        second = wait_download(browser, timeout=20)
        assert second != pdf and second.parent == browser.downloads
    with pool.lease() as browser:  # the next lease starts with empty downloads
        assert list(browser.downloads.iterdir()) == []


def in_a_forked_child(pool: BrowserPool, answers: multiprocessing.Queue[str]) -> None:
    with pool.lease() as browser:
        browser.driver.get("about:blank")
        answers.put(f"{os.getpid()} {browser.profile.name}")
    pool.close()


def test_a_pool_used_after_fork_builds_the_childs_own_browser(pool: BrowserPool, peer: ErpPeer) -> None:
    with pool.lease() as browser:
        parent = browser.profile
    answers: multiprocessing.Queue[str] = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=in_a_forked_child, args=(pool, answers))
    child.start()
    pid, name = answers.get(timeout=30).split()
    child.join(30)
    assert child.exitcode == 0
    assert name.startswith(f"{pid}-") and int(pid) != os.getpid()
    with pool.lease() as browser:  # the parent's browser was neither used nor quit by the child
        assert browser.profile == parent
        browser.driver.get("about:blank")


OWNER = """
import sys, time
from pathlib import Path
from tasks.operations.browser import BrowserPool
pool = BrowserPool(Path(sys.argv[1]), chromium={chromium!r}, chromedriver={chromedriver!r})
with pool.lease() as browser:
    browser.driver.get("about:blank")
    print(browser.profile, browser.service.process.pid, flush=True)
    time.sleep(120)
"""


def test_the_sweep_kills_the_chromium_of_a_sigkilled_owner_and_removes_its_profile(
    tmp_path: Path, peer: ErpPeer
) -> None:
    script = textwrap.dedent(OWNER).format(chromium=CHROMIUM, chromedriver=CHROMEDRIVER)
    owner = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().split()
        assert line, "the owner process never leased a browser"
        profile, chromedriver = Path(line[0]), int(line[1])
        # A live owner's browser is never swept.
        assert sweep_orphans(tmp_path) == 0 and using(profile) and profile.exists()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(10)
    assert gone([chromedriver]), "chromedriver outlived its owner (PR_SET_PDEATHSIG)"
    orphans = using(profile)
    assert orphans, "expected Chromium to outlive a SIGKILLed owner"
    assert sweep_orphans(tmp_path) >= 1
    assert gone(orphans), f"orphaned Chromium processes live on: {orphans}"
    assert not using(profile)
    assert not profile.exists()
    assert sweep_orphans(tmp_path) == 0
