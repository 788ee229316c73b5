"""The console in a real headless Chromium (Debian's ``chromium`` + ``chromium-driver``,
driven by Selenium): what a reviewer and an auditor do, end to end, against a real API,
PostgreSQL and an in-process replay worker on the tiny-demo engine.

With ``LEDGER_SCREENSHOTS=DIR`` each page is saved as ``DIR/<name>.png`` (the README's
pictures come from ``LEDGER_SCREENSHOTS=docs/console``).
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.console.conftest import XSS_PROMPT, ConsoleStack

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    import selenium  # noqa: F401
    HAVE_SELENIUM = True
except ImportError:
    HAVE_SELENIUM = False

pytestmark = pytest.mark.skipif(
    not (CHROMIUM and DRIVER and HAVE_SELENIUM),
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium "
           "chromium-driver; scripts/test installs them) and selenium (the dev extra)")

SHOTS = os.environ.get("LEDGER_SCREENSHOTS")


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    downloads = tmp_path_factory.mktemp("downloads")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1280,900", "--hide-scrollbars", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    options.add_experimental_option("prefs", {"download.default_directory": str(downloads),
                                              "download.prompt_for_download": False})
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    driver.execute_cdp_cmd("Page.setDownloadBehavior",
                           {"behavior": "allow", "downloadPath": str(downloads)})
    driver.downloads = downloads
    driver.implicitly_wait(2)
    try:
        yield driver
    finally:
        driver.quit()


def shot(driver: Any, name: str) -> None:
    """Save the whole page (taller windows for long pages) when screenshots are asked for."""
    if not SHOTS:
        return
    out = Path(SHOTS)
    out.mkdir(parents=True, exist_ok=True)
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, min(max(int(height), 700), 2400))
    driver.save_screenshot(str(out / f"{name}.png"))
    driver.set_window_size(1280, 900)


def sign_in(driver: Any, stack: ConsoleStack, role: str, name: str | None = None) -> None:
    from selenium.webdriver.common.by import By

    driver.delete_all_cookies()
    driver.get(stack.url + "/console/sign-in")
    driver.find_element(By.ID, "api_key").send_keys(stack.keys[role])
    if name:
        shot(driver, name)
    submit(driver, driver.find_element(By.ID, "sign-in"))


def submit(driver: Any, button: Any) -> None:
    """Click a form's button and wait for the page it leads to."""
    from selenium.common.exceptions import WebDriverException

    button.click()

    def gone() -> bool:
        try:
            button.is_enabled()  # raises once the old page is gone
            return False
        except WebDriverException:
            return True
    wait_for(gone, timeout=30, every=0.05)


def wait_for(predicate: Any, timeout: float = 60, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError("timed out")


def test_an_ingester_is_refused(browser: Any, console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, console_stack, "ingester")
    assert "has no console" in browser.find_element(By.ID, "error").text
    assert "/console/sign-in" in browser.current_url
    shot(browser, "sign-in-ingester-refused")
    browser.get(console_stack.url + "/console/search")
    assert "/console/sign-in" in browser.current_url  # no session was made


def test_reviewer_searches_reads_disputes_and_resolves(browser: Any,
                                                       console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    stack = console_stack
    sign_in(browser, stack, "reviewer", name="sign-in")
    assert browser.current_url.endswith("/console/search"), browser.page_source[-1500:]
    shot(browser, "search")
    # search: a request ID prefix, then the model name in another case
    browser.find_element(By.ID, "q").send_keys("demo-console-a")
    submit(browser, browser.find_element(By.ID, "search"))
    links = [a.text for a in browser.find_elements(By.CSS_SELECTOR, "a.rid")]
    assert links == [stack.altered]
    browser.get(stack.url + "/console/search?model=Tiny-Demo")
    assert len(browser.find_elements(By.CSS_SELECTOR, "a.rid")) == 10

    # the honest record: verified, readable, hover shows token IDs
    browser.get(stack.url + f"/console/requests/{stack.honest}")
    verification = browser.find_element(By.ID, "verification")
    assert verification.text.startswith("Verified")
    prompt = browser.find_element(By.CSS_SELECTOR, ".tokens.prompt")
    assert prompt.text.startswith("<bos>")
    first = prompt.find_elements(By.CSS_SELECTOR, ".tok")[1]
    assert first.get_attribute("title").startswith("#")
    shot(browser, "request-honest")
    submit(browser, browser.find_element(By.ID, "toggle-ids"))
    assert browser.find_elements(By.CSS_SELECTOR, ".tokens.prompt sup")
    shot(browser, "request-token-ids")

    # open disputes on the honest and on the altered record, from their pages
    disputes = {}
    for rid, reason in ((stack.honest, "customer questions this answer"),
                        (stack.altered, "answer looks edited after the fact")):
        browser.get(stack.url + f"/console/requests/{rid}")
        if rid == stack.altered:
            assert browser.find_element(By.ID, "verification").text.startswith("Verified")
            shot(browser, "request-altered")  # re-signed by the gateway: the signature holds
        browser.find_element(By.ID, "reason").send_keys(reason)
        Select(browser.find_element(By.NAME, "priority")).select_by_visible_text("high")
        submit(browser, browser.find_element(By.ID, "open-dispute"))
        assert "/console/disputes/" in browser.current_url
        disputes[rid] = browser.current_url

    # follow each to its verdict (the worker replays it on the tiny-demo engine)
    stack.publisher.wait_idle(120)
    for url in disputes.values():
        def has_verdict(url: str = url) -> bool:
            browser.get(url)
            return bool(browser.find_elements(By.ID, "see-diff"))
        wait_for(has_verdict)
    browser.get(disputes[stack.honest])
    assert "reproduced · bitwise" in browser.find_element(By.CSS_SELECTOR, ".badge").text
    submit(browser, browser.find_element(By.ID, "see-diff"))
    assert not browser.find_elements(By.ID, "step-k")
    shot(browser, "verdict-reproduced")

    browser.get(disputes[stack.altered])
    assert "diverged" in browser.find_element(By.CSS_SELECTOR, ".badge").text
    shot(browser, "dispute-verdict")
    submit(browser, browser.find_element(By.ID, "see-diff"))
    assert f"k = {stack.k}" in browser.find_element(By.ID, "divergence").text
    row = browser.find_element(By.ID, "step-k")
    cells = row.find_elements(By.TAG_NAME, "td")
    assert cells[0].text == str(stack.k) and "k" in row.get_attribute("class").split()
    assert cells[1].text != cells[3].text  # recorded vs replayed token at k
    assert f"#{stack.extra['original_k']}" in cells[3].text  # the replay has the original
    bg = cells[0].value_of_css_property("background-color")
    assert bg not in ("rgba(0, 0, 0, 0)", "rgb(255, 255, 255)")  # highlighted
    assert len(browser.find_elements(By.CSS_SELECTOR, "figure.chart svg")) >= 4
    shot(browser, "verdict-diff")

    # comment, then resolve, from the dispute page
    browser.get(disputes[stack.altered])
    browser.find_element(By.ID, "comment-text").send_keys("diff shows token 4 was replaced")
    submit(browser, browser.find_element(By.ID, "comment"))
    assert "diff shows token 4 was replaced" in browser.find_element(
        By.CSS_SELECTOR, "ol.timeline").text
    Select(browser.find_element(By.ID, "resolution-choice")).select_by_value("upheld")
    browser.find_element(By.ID, "resolve-note").send_keys("the stored output was altered")
    submit(browser, browser.find_element(By.ID, "resolve"))
    assert "upheld" in browser.find_element(By.ID, "resolution").text
    shot(browser, "dispute-resolved")
    api = httpx.get(f"{stack.url}/v1/disputes/{disputes[stack.altered].rsplit('/', 1)[1]}",
                    headers={"Authorization": f"Bearer {stack.keys['reviewer']}"}).json()
    assert api["resolution"] == "upheld"
    assert [e["kind"] for e in api["events"]][-2:] == ["comment", "resolved"]

    browser.get(stack.url + "/console/disputes?state=")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#queue tbody tr, #queue tr.prio-high")) >= 2
    shot(browser, "dispute-queue")


def test_html_and_script_in_a_prompt_render_inert(browser: Any,
                                                  console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, console_stack, "reviewer")
    browser.get(console_stack.url + f"/console/requests/{console_stack.xss}")
    assert browser.execute_script("return window.__pwned === undefined")
    assert not browser.find_elements(By.CSS_SELECTOR, "main img, .tokens b, .tokens script")
    assert browser.find_element(By.CSS_SELECTOR, ".tokens.prompt").text == "<bos>" + XSS_PROMPT
    shot(browser, "request-html-prompt")


def test_a_form_post_without_the_csrf_token_fails(browser: Any,
                                                  console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, console_stack, "reviewer")
    browser.get(console_stack.url + f"/console/requests/{console_stack.xss}")
    browser.execute_script(
        "document.querySelector('#dispute-form input[name=csrf_token]').remove()")
    browser.find_element(By.ID, "reason").send_keys("forged form")
    submit(browser, browser.find_element(By.ID, "open-dispute"))
    assert "CSRF" in browser.find_element(By.ID, "error").text
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("403")
    browser.get(console_stack.url + f"/console/requests/{console_stack.xss}")
    assert "never disputed" in browser.page_source  # nothing was written


def test_reverification_drift_plot(browser: Any, console_stack: ConsoleStack) -> None:
    """A policy's windows over the last hour, each with a different share of records a
    gateway altered: the page plots each run's drift rate against its window."""
    import copy
    from datetime import UTC, datetime

    from selenium.webdriver.common.by import By

    from ledger.core.envelope import output_digest
    from ledger.producer import envelope_to_json, sign_statement
    from ledger.replay import beat

    stack = console_stack
    base = datetime.now(UTC).replace(second=0, microsecond=0) - timedelta(minutes=65)
    altered = {5, 9, 10, 13, 17, 18, 19, 22}  # per 10-minute window of 4: 0 1 2 1 3 1 0
    envelopes = []
    for j in range(28):
        st = copy.deepcopy(stack.extra["statements"][j % len(stack.extra["statements"])])
        rid = f"demo-console-past-{j:02d}"
        st["predicate"]["request_id"] = rid
        st["predicate"]["recorded_at"] = (base + timedelta(seconds=150 * j + 30)).isoformat()
        tokens = st["predicate"]["output"]["token_ids"]
        if j in altered:
            tokens[2] = (tokens[2] + 1) % 256
        st["subject"] = [{"name": rid, "digest": {"sha256": output_digest(tokens)}}]
        envelopes.append(envelope_to_json(sign_statement(st, stack.extra["gateway"])))
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        r = c.post("/v1/envelopes/batch", params={"wait": True, "timeout": 30},
                   json={"envelopes": envelopes},
                   headers={"Authorization": f"Bearer {stack.keys['ingester']}"})
        assert r.status_code == 200 and r.json()["created"] == 28, r.text
        r = c.post("/v1/reverification-policies", json={
            "name": "ten-minute sample", "interval_seconds": 600, "sample_rate": 1.0,
            "first_window_start": base.isoformat(), "max_age_seconds": 7200},
            headers={"Authorization": f"Bearer {stack.keys['admin']}"})
        assert r.status_code == 201, r.text
    from ledger.replay.records import Signer

    # the beat claims windows with the service key: each claim is a signed leaf
    beat.tick(stack.db, stack.publisher, stack.settings,
              Signer.from_file(stack.settings.service_key_file, "ledger", "ledger-service"))
    stack.publisher.wait_idle(120)
    sign_in(browser, stack, "reviewer")
    browser.get(stack.url + "/console/reverification")
    rates = [row.find_elements(By.TAG_NAME, "td")[7].text
             for row in browser.find_elements(By.CSS_SELECTOR, "#runs tr")[1:]]
    assert {"0.0%", "25.0%", "50.0%", "75.0%"} <= set(rates), rates
    assert len(browser.find_elements(By.CSS_SELECTOR, "svg circle.dot")) >= 6
    shot(browser, "reverification")


def test_an_auditor_exports_a_bundle_that_verifies(browser: Any,
                                                   console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By

    from ledger.core.bundle import verify_bundle
    from ledger.core.trust import load_trust_policy

    stack = console_stack
    sign_in(browser, stack, "auditor")
    browser.get(stack.url + "/console/export")
    browser.find_element(By.ID, "request-ids").send_keys(f"{stack.honest}\n{stack.altered}")
    shot(browser, "export")
    browser.find_element(By.ID, "export").click()
    bundle = browser.downloads / "ledger-bundle.jsonl"
    wait_for(lambda: bundle.exists() and bundle.stat().st_size > 0
             and not list(browser.downloads.glob("*.crdownload")))
    summary = verify_bundle(bundle.read_bytes(),
                            trust=load_trust_policy(stack.settings.trust_policy_file))
    assert summary.records >= 2
    # a reviewer has no export
    sign_in(browser, stack, "reviewer")
    browser.get(stack.url + "/console/export")
    assert browser.find_element(By.TAG_NAME, "h1").text.startswith("403")


def test_admin_sees_tokenizers_and_api_docs_load_offline(browser: Any,
                                                         console_stack: ConsoleStack) -> None:
    from selenium.webdriver.common.by import By

    sign_in(browser, console_stack, "admin")
    browser.get(console_stack.url + "/console/tokenizers")
    assert "tiny-demo" in browser.find_element(By.ID, "tokenizers").text
    shot(browser, "tokenizers")
    browser.get(console_stack.url + "/docs")
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, ".swagger-ui .opblock"))
    shot(browser, "api-docs")
