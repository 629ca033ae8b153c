"""The console in a real headless browser: Debian's ``chromium`` driven through its own
``chromium-driver`` by Selenium (nothing downloaded), against ``conveyor serve`` and an
in-process worker. A dead-lettered job appears in the list, its cause is fixed, Retry is
clicked, the row leaves the list and the job reaches ``succeeded``.

Screenshots are kept (the list with the dead letter, then the job's page):
``console-dead-letters.png`` and ``console-job.png`` in the test's ``tmp_path`` and in
``$CONVEYOR_ARTIFACTS`` (default ``.artifacts/`` at the checkout's root).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conveyor.web import tokens
from tasks.demo.logic import fix
from tests.integration.http_support import serving

pytestmark = pytest.mark.timeout(120)

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
ROOT = Path(__file__).resolve().parents[2]
WAIT = 20.0


def major(binary: str) -> int:
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout
    found = re.search(r"(\d+)\.\d+\.\d+", out)
    assert found, f"{binary} --version said {out!r}"
    return int(found.group(1))


@pytest.fixture(scope="module")
def chrome(request: pytest.FixtureRequest) -> Iterator[Any]:
    """Headless Chromium through chromedriver (both Debian's, of the same major version)."""
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
        missing = "chromium and chromium-driver are not installed (apt-get install chromium chromium-driver)"
        if request.config.getoption("--require-services"):
            pytest.fail(missing)
        pytest.skip(missing)
    browser, driver = major(CHROMIUM), major(CHROMEDRIVER)
    assert browser == driver, f"chromium {browser} and chromedriver {driver} differ: install both from apt"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1280,860"):
        options.add_argument(arg)
    chrome = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    chrome.implicitly_wait(0)
    yield chrome
    chrome.quit()


def artifact_dir() -> Path:
    """Where test artifacts are kept: ``$CONVEYOR_ARTIFACTS``, else ``.artifacts/``."""
    path = Path(os.environ.get("CONVEYOR_ARTIFACTS") or ROOT / ".artifacts")
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_a_dead_letter_is_retried_from_the_console_once_its_cause_is_fixed(
    platform: Any, worker: Any, chrome: Any, tmp_path: Path, tag: str
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(chrome, WAIT)
    admin = tokens.create(platform.engine, owner=f"ops-{tag}", scopes=["admin"]).secret
    with serving(platform, tmp_path / "serve.log") as (base, _):
        # Given an operator signed in with an admin token, on the dead-letter page
        chrome.get(f"{base}/console/dead-letters")
        chrome.find_element(By.ID, "token").send_keys(admin)
        chrome.find_element(By.CSS_SELECTOR, "form.login button").click()
        wait.until(ec.url_to_be(f"{base}/console"))
        chrome.get(f"{base}/console/dead-letters")
        wait.until(lambda c: c.find_element(By.ID, "live").get_attribute("data-connected") == "true")

        # When a job dies, its row appears without a reload (the page's event stream)
        key = f"order-{uuid.uuid4().hex[:8]}"
        job_id = platform.submit("conveyor.demo.fixable", {"key": key}, owner=f"ops-{tag}").id
        row = wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, f'tr[data-job="{job_id}"]')))
        entry = row.get_attribute("id")
        assert "is broken: fix its cause" in row.text
        shots = [tmp_path / "console-dead-letters.png"]
        assert chrome.save_screenshot(str(shots[-1]))

        # and once its cause is fixed, Retry sends it back: the row leaves the list
        fix(platform.engine, key)
        row.find_element(By.CSS_SELECTOR, "button").click()
        wait.until(ec.text_to_be_present_in_element((By.CSS_SELECTOR, "p.notice"), f"Job {job_id}"))
        assert not chrome.find_elements(By.ID, entry)

        # Then the job's page shows it succeeded (live, when it was still on its way)
        chrome.get(f"{base}/console/jobs/{job_id}")
        wait.until(ec.text_to_be_present_in_element((By.ID, "job-status"), "succeeded"))
        timeline = chrome.find_element(By.CSS_SELECTOR, "ol.timeline").text
        assert "job.dead" in timeline and "job.succeeded" in timeline
        shots.append(tmp_path / "console-job.png")
        assert chrome.save_screenshot(str(shots[-1]))
    for shot in shots:
        shutil.copy(shot, artifact_dir() / shot.name)
