"""The distill.serve playground page (``GET /``) and the API page (``/docs``) in a real headless browser: the system's
Chromium driven by Selenium.

One server (``python -m distill.serve`` as users start it, on 127.0.0.1 with a free port, the shipped teacher at 4
steps, stream mode) and one browser serve the module's tests. The page must produce exactly the images the Python
client gets for the same settings (size, scheduler and number of images included), show the latency and seed,
show each denoising step while a request runs and cancel it, answer a bad value with the server's 422 naming the
field in place of the last image, and show the model by its name only, without console errors. /docs must render
the API with every other host unreachable (Swagger UI served by the service itself). Needs the Debian packages
chromium and chromium-driver (``apt-get install chromium chromium-driver``; .ci/run installs them); the tests
skip where either binary is missing. Selenium is given both paths so that selenium-manager never looks for a
driver on the network.
"""

from __future__ import annotations

import base64
import io
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
BOOT_TIMEOUT_S = 120  # model load on a busy CI worker; here it takes ~6 s
WAIT_S = 60  # one 32x32 image at 4 steps takes ~0.1 s; the bound only matters when something hangs
STEPS, GUIDANCE, SEED = 3, 2.5, 1234  # not the server's defaults (4, 3.0), so the inputs demonstrably reach it
KEY_ITEM = "distill.serve.api_key"  # the page's sessionStorage item
LONG_STEPS = 100  # engine.max_steps: ~1-2 s of denoising, so that many 100 ms polls of the page land mid-way
PROMPT = "a handwritten digit seven"


def _binary(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


CHROMIUM = _binary("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _binary("chromedriver")
MISSING = [f"{name} (not on PATH)" for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not path]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the browser tests need {' and '.join(MISSING)}: "
                                                      "apt-get install chromium chromium-driver")


class Served:
    """``python -m distill.serve`` in a subprocess: ``proc``, ``lines`` (its stdout, line by line, None at the end)
    and ``ready()`` (its URL, once it printed it and /health answers ok)."""

    def __init__(self, *overrides: str, log: Path):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log, self.url = log, None
        with open(log, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-m", "distill.serve", *overrides], cwd=ROOT, env=env,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.deadline = time.monotonic() + BOOT_TIMEOUT_S
        # a thread reads stdout, so that the pipe never fills and the URL line can be awaited with a timeout
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _stderr(self) -> str:
        return self.log.read_text()[-3000:]

    def ready(self) -> str:
        import httpx

        seen = []
        while self.url is None:
            try:
                line = self.lines.get(timeout=max(0.1, self.deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"distill.serve printed no URL within {BOOT_TIMEOUT_S} s; stderr:\n{self._stderr()}")
            if line is None:
                pytest.fail(f"distill.serve exited ({self.proc.wait()}) before serving; stdout: {seen}\n"
                            f"stderr:\n{self._stderr()}")
            seen.append(line)
            match = re.fullmatch(r"distill\.serve: .* on (http://127\.0\.0\.1:\d+)", line.strip())
            self.url = match and match.group(1)
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).json()["status"] == "ok":
                    return self.url
            except httpx.TransportError:
                pass
            if time.monotonic() > self.deadline:
                pytest.fail(f"{self.url}/health never answered ok; stderr:\n{self._stderr()}")
            time.sleep(0.1)

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM (if still running) and its exit status; killed, and the test failed, past ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
            pytest.fail(f"distill.serve did not stop within {timeout} s of SIGTERM; killed. stderr:\n{self._stderr()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server, launched (not awaited: the browser starts while it loads the model); stopped at the end."""
    served = Served("port=0", "host=127.0.0.1", "steps=4", "engine.mode=stream", "threads=1",
                    log=tmp_path_factory.mktemp("serve") / "stderr.txt")
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A headless Chromium (fresh profile, no host but 127.0.0.1 resolves) that records the console."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-quic",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1000,800",
                 # every host but the server's is unreachable: a page that needs a CDN fails here as offline
                 "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    driver.set_script_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(server, browser):
    """The playground, open: url, driver, the server's /health, the served pipeline's path, and a count of the 422s
    the page was answered."""
    import httpx

    from distill.worlds.digits import asset_path

    url = server.ready()
    browser.get(url + "/")
    return SimpleNamespace(url=url, driver=browser, health=httpx.get(f"{url}/health", timeout=10).json(), rejected=0,
                           pipeline=str(asset_path("teacher")))


def _status(driver, predicate, what: str) -> str:
    """#status's text once ``predicate(text, classes)`` holds and the page is idle (bounded wait); the text."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    element = driver.find_element(By.ID, "status")
    try:
        WebDriverWait(driver, WAIT_S, poll_frequency=0.05).until(
            lambda _: predicate(element.text, element.get_attribute("class") or "")
            and not driver.find_element(By.ID, "generate").get_attribute("disabled"))
    except Exception as err:  # noqa: BLE001 - report what the page shows
        raise AssertionError(f"waiting for {what}: #status reads {element.text!r} "
                             f"(class {element.get_attribute('class')!r})") from err
    return element.text


def _pixels(png: bytes) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"), dtype=np.int16)


def _shown_images(driver) -> list[np.ndarray]:
    """The images the page shows (visible ones only), decoded."""
    from selenium.webdriver.common.by import By

    shown = []
    for image in driver.find_elements(By.CSS_SELECTOR, "#images img"):
        if image.is_displayed():
            src = image.get_attribute("src")
            assert src.startswith("data:image/png;base64,"), src[:40]
            shown.append(_pixels(base64.b64decode(src.split(",", 1)[1])))
    return shown


def _set(driver, **values) -> None:
    """Set inputs through JS (past the browser's own min/required checks)."""
    driver.execute_script(
        "for (const [id, value] of Object.entries(arguments[0])) document.getElementById(id).value = value;", values)


def _submit(driver) -> None:
    driver.execute_script("document.getElementById('form').dispatchEvent(new Event('submit', {cancelable: true}));")


def _record_status(driver) -> None:
    """Record every text #status shows from now on (window.seen), however briefly."""
    driver.execute_script(
        "window.seen = []; const status = document.getElementById('status');"
        "new MutationObserver(() => window.seen.push(status.textContent))"
        ".observe(status, {childList: true, characterData: true, subtree: true});")


DONE = re.compile(r"\d+ ms \(server \d+ ms\), seeds? [\d-]+")


def test_page_shows_the_servers_defaults_and_the_model_by_name(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from distill.inference.schedulers import SCHEDULERS

    driver, health = page.driver, page.health
    defaults = health["defaults"]
    assert driver.title == "distill.serve playground"
    value = lambda id_: driver.find_element(By.ID, id_).get_attribute("value")  # noqa: E731
    assert int(value("steps")) == defaults["steps"] == 4
    assert float(value("guidance")) == defaults["guidance_scale"]
    assert int(value("width")) == defaults["width"] and int(value("height")) == defaults["height"]
    assert value("seed") == "" and value("prompt") == "" and value("images-count") == "1" and value("api-key") == ""
    assert driver.find_element(By.ID, "steps").get_attribute("max") == str(defaults["max_steps"])
    assert driver.find_element(By.ID, "images-count").get_attribute("max") == str(defaults["max_batch_size"])
    assert driver.find_element(By.ID, "width").get_attribute("step") == str(defaults["vae_factor"])
    options = [o.get_attribute("value") for o in Select(driver.find_element(By.ID, "scheduler")).options]
    assert options == ["", *sorted(SCHEDULERS)]  # "": the server's default
    intro = driver.find_element(By.TAG_NAME, "p").text
    assert f"{defaults['steps']} steps" in intro and defaults["scheduler"] in intro
    # the model by its name: the folder's name, not where it lies on the server's disk
    model = intro.split("·")[0].strip()
    assert model == health["model"] == Path(page.pipeline).name, (model, health["model"])
    assert page.pipeline not in driver.page_source and "/" not in model
    assert "{{" not in driver.page_source, "a template placeholder was left unfilled"
    assert _shown_images(driver) == [] and not driver.find_element(By.ID, "bar").is_displayed()


def test_page_generates_the_clients_image(page):
    from selenium.webdriver.common.by import By

    from distill.serve import Client

    url, driver = page.url, page.driver
    driver.find_element(By.ID, "prompt").send_keys(PROMPT)
    for id_, value in (("steps", STEPS), ("guidance", GUIDANCE), ("seed", SEED)):
        box = driver.find_element(By.ID, id_)
        box.clear()
        box.send_keys(str(value))
    driver.find_element(By.ID, "generate").click()
    text = _status(driver, lambda text, classes: DONE.fullmatch(text) or "error" in classes, "the image")
    assert re.fullmatch(rf"\d+ ms \(server \d+ ms\), seed {SEED}", text), text
    shown, server_ms = map(int, re.findall(r"(\d+) ms", text))
    assert 0 <= server_ms <= shown + 1  # the server's part of the round trip cannot exceed it

    [got] = _shown_images(driver)
    with Client(url, timeout=WAIT_S) as client:
        want = client.generate(PROMPT, steps=STEPS, guidance_scale=GUIDANCE, seed=SEED)
    assert want.seeds == [SEED] and want.info["steps"] == STEPS and want.info["guidance_scale"] == GUIDANCE
    expected = _pixels(want.png[0])
    assert got.shape == expected.shape == (32, 32, 3)
    assert np.abs(got - expected).max() <= 1, "the page's image differs from the client's for the same settings"
    assert got.std() > 0, "a blank image"


def test_the_api_key_goes_with_every_request_and_stays_for_the_tab(page):
    """A key typed in the box is sent as ``Authorization: Bearer <key>`` on the submission and every poll, kept in
    sessionStorage across a reload of the tab; an emptied box sends no header."""
    from selenium.webdriver.common.by import By

    driver = page.driver
    driver.find_element(By.TAG_NAME, "summary").click()  # the box sits folded away
    driver.find_element(By.ID, "api-key").send_keys("s3cret")
    driver.refresh()
    assert driver.find_element(By.ID, "api-key").get_attribute("value") == "s3cret"
    record = ("window.sent = []; const inner = window.fetch; window.fetch = (url, options = {}) => {"
              "  const key = (options.headers || {}).Authorization || null;"
              "  window.sent.push([options.method || 'GET', String(url), key]); return inner(url, options); };")
    for key in ("s3cret", ""):
        driver.execute_script(record)
        _set(driver, prompt=PROMPT, steps=str(STEPS), seed=str(SEED), **{"api-key": key})
        driver.execute_script("document.getElementById('api-key').dispatchEvent(new Event('input'));")
        _submit(driver)
        _status(driver, lambda text, classes: DONE.fullmatch(text) or "error" in classes, "the image")
        sent = driver.execute_script("return window.sent")
        assert sent[0][:2] == ["POST", "/jobs"] and sent[-1][1].startswith("/jobs/") and len(sent) >= 2, sent
        assert {header for *_, header in sent} == {f"Bearer {key}" if key else None}, sent
        assert driver.execute_script(f"return sessionStorage.getItem({json.dumps(KEY_ITEM)})") == key


def test_page_sends_size_scheduler_and_number_of_images(page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    from distill.serve import Client

    driver, defaults = page.driver, page.health["defaults"]
    side = defaults["width"] + 2 * defaults["vae_factor"]  # not the native size
    _set(page.driver, prompt=PROMPT, steps=str(STEPS), guidance=str(GUIDANCE), seed=str(SEED), width=str(side),
         height=str(side), **{"images-count": "2"})
    Select(driver.find_element(By.ID, "scheduler")).select_by_value("euler")
    driver.find_element(By.ID, "generate").click()
    text = _status(driver, lambda text, classes: DONE.fullmatch(text) or "error" in classes, "two images")
    assert text.endswith(f"seeds {SEED}-{SEED + 1}"), text
    shown = _shown_images(driver)
    with Client(page.url, timeout=WAIT_S) as client:
        want = client.generate([PROMPT, PROMPT], steps=STEPS, guidance_scale=GUIDANCE, seed=SEED, width=side,
                               height=side, scheduler="euler")
    assert want.info["scheduler"] == "euler" and len(shown) == len(want.png) == 2
    for got, png in zip(shown, want.png):
        assert got.shape == (side, side, 3) and np.abs(got - _pixels(png)).max() <= 1
    assert np.abs(shown[0] - shown[1]).max() > 0, "seeds seed and seed + 1 gave one image"


def test_page_shows_each_step_while_a_request_runs(page):
    driver = page.driver
    _set(driver, prompt=PROMPT, steps=str(LONG_STEPS), seed=str(SEED), width="", height="", scheduler="",
         **{"images-count": "1"})
    _record_status(driver)
    _submit(driver)
    _status(driver, lambda text, classes: DONE.fullmatch(text) or "error" in classes, "the image")
    seen = driver.execute_script("return window.seen")
    steps = [int(m.group(1)) for text in seen if (m := re.fullmatch(rf"denoise: step (\d+)/{LONG_STEPS}", text))]
    midway = sorted({k for k in steps if 0 < k < LONG_STEPS})
    assert len(midway) >= 2, f"the page showed too few steps of {LONG_STEPS}: {seen}"
    assert steps == sorted(steps), f"progress went backwards: {steps}"
    assert DONE.fullmatch(seen[-1]) and len(_shown_images(driver)) == 1


def test_cancel_stops_the_request_and_clears_the_image(page):
    import httpx
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = page.driver
    assert len(_shown_images(driver)) == 1  # the last test's
    _set(driver, prompt=PROMPT, steps=str(LONG_STEPS), seed=str(SEED))
    _submit(driver)
    assert _shown_images(driver) == [], "a new request still shows the last image"
    status = driver.find_element(By.ID, "status")
    WebDriverWait(driver, WAIT_S, poll_frequency=0.02).until(
        lambda _: re.fullmatch(rf"denoise: step [1-9]\d*/{LONG_STEPS}", status.text))
    key = driver.find_element(By.ID, "form").get_attribute("data-job")
    driver.find_element(By.ID, "cancel").click()
    text = _status(driver, lambda text, classes: "error" in classes, "the cancel")
    assert re.fullmatch(rf"cancelled at step (\d+)/{LONG_STEPS}", text), text
    job = httpx.get(f"{page.url}/jobs/{key}", timeout=10).json()
    assert job["status"] == "cancelled" and job["step"] < LONG_STEPS, job
    assert int(re.search(r"step (\d+)", text).group(1)) == job["step"]
    assert _shown_images(driver) == [] and driver.find_element(By.ID, "cancel").get_attribute("disabled")


def _submit_with(page, **values: str) -> str:
    """Set inputs, submit the form (the submit handler resets #status at once) and return #status's text once the
    answer is shown."""
    _set(page.driver, **values)
    _submit(page.driver)
    text = _status(page.driver, lambda text, classes: "error" in classes or DONE.fullmatch(text), "the answer")
    page.rejected += text.startswith("error 422: ")
    return text


def test_page_shows_422_naming_the_field_in_place_of_the_image(page):
    from selenium.webdriver.common.by import By

    driver = page.driver
    text = _submit_with(page, prompt=PROMPT, steps=str(STEPS), guidance=str(GUIDANCE), seed=str(SEED))
    assert DONE.fullmatch(text) and len(_shown_images(driver)) == 1
    # a value the engine rejects (its message names the field): the old image goes with it ...
    text = _submit_with(page, steps="0")
    assert "error" in driver.find_element(By.ID, "status").get_attribute("class").split()
    assert text.startswith("error 422: ") and "steps" in text and "must lie in [1, 100]" in text, text
    assert _shown_images(driver) == [], "the last image is still shown beside the error"
    # ... one pydantic rejects (its message does not: the page adds the field's name) ...
    text = _submit_with(page, steps=str(STEPS), seed="-1")
    assert text.startswith("error 422: seed: ") and "greater than or equal to 0" in text, text
    # ... an empty prompt, and a size off the VAE's grid
    text = _submit_with(page, prompt="", seed=str(SEED))
    assert text.startswith("error 422: prompt: ") and "non-empty" in text, text
    text = _submit_with(page, prompt=PROMPT, width=str(page.health["defaults"]["width"] + 1))
    assert text.startswith("error 422: ") and "width" in text and "multiple of the VAE factor" in text, text
    # the page still works after the errors
    text = _submit_with(page, width=str(page.health["defaults"]["width"]))
    assert re.fullmatch(rf"\d+ ms \(server \d+ ms\), seed {SEED}", text), text
    assert "error" not in (driver.find_element(By.ID, "status").get_attribute("class") or "")
    assert len(_shown_images(driver)) == 1


def test_page_logs_no_console_errors(page):
    """Nothing SEVERE in the console but the expected: Chromium logs every non-2xx fetch as a network error
    ('<url>/jobs - Failed to load resource: the server responded with a status of 422 (...)'), even one the
    page handles, and the previous test provoked 422s on purpose; exactly those lines (one per 422, matched by URL
    and status) are let through."""
    url = page.url
    logs = page.driver.get_log("browser")
    assert all({"level", "message"} <= set(entry) for entry in logs)
    expected_422 = re.compile(re.escape(f"{url}/jobs") + r" - Failed to load resource: .*status of 422\b")
    severe = [entry["message"] for entry in logs if entry["level"] == "SEVERE"]
    assert [m for m in severe if not expected_422.match(m)] == [], "console errors on the playground page"
    assert len([m for m in severe if expected_422.match(m)]) == page.rejected, severe


def test_docs_render_the_api_offline(page):
    """/docs lists the operations with every host but the server's unreachable (the browser's resolver fails them
    all): its scripts and styles come from the service itself."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = page.driver
    driver.get(page.url + "/docs")
    WebDriverWait(driver, WAIT_S, poll_frequency=0.1).until(
        lambda _: driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path"))
    paths = {e.get_attribute("data-path") for e in driver.find_elements(By.CSS_SELECTOR, ".opblock-summary-path")}
    assert {"/generate", "/jobs", "/jobs/{id}", "/health"} <= paths, paths
    loaded = driver.execute_script("return performance.getEntriesByType('resource').map(e => e.name)")
    assert loaded and all(name.startswith(page.url + "/") for name in loaded), loaded
    severe = [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == [], severe


def test_server_exits_0_on_sigterm(server):
    """The last test: SIGTERM drains and stops the server, which exits 0 after printing that it stopped."""
    server.ready()
    code = server.stop()
    assert code == 0, f"distill.serve exited {code} on SIGTERM; stderr:\n{server._stderr()}"
    rest = []
    while (line := server.lines.get(timeout=10)) is not None:
        rest.append(line.strip())
    assert rest == ["distill.serve: stopped"], rest
