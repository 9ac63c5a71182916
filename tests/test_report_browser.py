"""The ``distill.report`` dashboard in a real headless browser: the system's Chromium driven by Selenium opens
``dashboard.html`` from disk (``file://``, no server, no network) and must draw every point of every run and the
Pareto front, name every run in the legend and the tables, show a point's run and numbers on hover, switch the x
axis to NFE, link existing sample grids, and log nothing SEVERE to the console. Needs the Debian packages chromium
and chromium-driver (as tests/test_serve_browser.py); skips where either binary is missing."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from urllib.parse import unquote

import pytest

from distill import report
from tests.test_report import LABELS, make_runs

# the legend's run names: the distinguishing keys' last component (the tables and hovers keep the whole label)
LEGEND = {job: ",".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in (part.split("=", 1) for part in label.split(",")))
          for job, label in LABELS.items()}

WAIT_S = 30


def _binary(*names: str) -> str | None:
    return next((path for name in names if (path := shutil.which(name))), None)


CHROMIUM = _binary("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = _binary("chromedriver")
MISSING = [f"{name} (not on PATH)" for name, path in (("chromium", CHROMIUM), ("chromedriver", CHROMEDRIVER)) if not path]
pytestmark = pytest.mark.skipif(bool(MISSING), reason=f"the browser tests need {' and '.join(MISSING)}: "
                                                      "apt-get install chromium chromium-driver")


@pytest.fixture(scope="module")
def dashboard(tmp_path_factory) -> dict:
    runs = make_runs(tmp_path_factory.mktemp("runs"))
    assert report.main([str(runs["multirun"]), str(runs["eval"]), "--out", str(runs["out"])]) == 0
    with open(runs["out"] / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {"path": runs["out"] / "dashboard.html", "rows": rows}


@pytest.fixture(scope="module")
def page(dashboard, tmp_path_factory):
    """Headless Chromium (fresh profile, network off) on the dashboard, once Plotly has drawn its points."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 f"--user-data-dir={tmp_path_factory.mktemp('chromium-profile')}", "--window-size=1400,1000"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(WAIT_S)
    try:
        driver.get(dashboard["path"].as_uri())
        WebDriverWait(driver, WAIT_S).until(
            lambda d: d.execute_script("return document.querySelectorAll('.scatterlayer .point').length") > 0)
        yield driver
    finally:
        driver.quit()


def test_every_point_run_and_front_drawn(page, dashboard):
    """A marker per measured point plus an open circle per point on the latency front; a legend entry per run and
    for the front; every run's label in the page's text."""
    rows = dashboard["rows"]
    points = page.execute_script("return document.querySelectorAll('.scatterlayer .point').length")
    assert points == len(rows) + sum(r["pareto"] == "1" for r in rows) == 13 + 8
    legend = page.execute_script(
        "return Array.from(document.querySelectorAll('.legend .traces')).map(e => e.textContent)")
    assert legend == ["teacher"] + [f"[{i}] {name}" for i, name in enumerate(LEGEND.values(), 1)] + [
        "[4] eval_mymodel", "Pareto front (latency)"]
    text = page.execute_script("return document.body.innerText")
    for label in [*LABELS.values(), "eval_mymodel", "teacher"]:
        assert label in text


def test_hover_names_the_run_and_its_numbers(page):
    """Hovering job 2's 4-step point shows its label, the overrides and the config that set it apart, its FID ± std."""
    from selenium.webdriver.common.action_chains import ActionChains

    index = page.execute_script(
        "const gd = document.getElementById('pareto');"
        "return gd.data.findIndex(t => t.name === arguments[0]);", f"[3] {LEGEND['2']}")
    assert index >= 0
    point = page.execute_script(
        "const traces = document.querySelectorAll('.scatterlayer .trace');"
        "return traces[arguments[0]].querySelectorAll('.point')[2];", index)  # sorted by latency: steps 4 last
    ActionChains(page).move_to_element(point).perform()
    hover = page.execute_script("const h = document.querySelector('.hoverlayer .hovertext'); "
                                "return h ? h.textContent : null")
    assert hover is not None, "no hover label"
    assert LABELS["2"] in hover
    assert "student._target_=distill.students.copies.lora_student" in hover  # the config difference
    assert "FID 6.00 ± 0.20" in hover and "NFE 4 ·" in hover
    assert "on the Pareto front" in hover


def test_switch_to_nfe(page, dashboard):
    """The 'x: nfe' button puts every trace on NFE and swaps the latency front for the NFE front."""
    from selenium.webdriver.common.by import By

    buttons = page.find_elements(By.CSS_SELECTOR, ".updatemenu-button")
    assert [b.text for b in buttons] == ["x: latency", "x: nfe"]
    buttons[1].click()
    state = page.execute_script(
        "const gd = document.getElementById('pareto');"
        "return [gd.layout.xaxis.title.text, gd.data.map(t => [t.name, t.x, t.visible])];")
    title, traces = state
    assert title == "NFE per image"
    by_name = {name: (x, visible) for name, x, visible in traces}
    assert by_name[f"[1] {LEGEND['0']}"][0] == [1.0, 2.0, 4.0]
    assert by_name["Pareto front (nfe)"][1] is True and by_name["Pareto front (latency)"][1] is False
    buttons[0].click()
    assert page.execute_script("return document.getElementById('pareto').layout.xaxis.title.text") == \
        "latency per image (s)"


def test_grid_links_exist(page, dashboard):
    """Each point's click target (customdata) and each link in the tables is a relative path to a file on disk."""
    out = dashboard["path"].parent
    custom = page.execute_script("return document.getElementById('pareto').data.flatMap(t => t.customdata || [])")
    links = page.execute_script("return Array.from(document.querySelectorAll('#runs a')).map(a => a.href)")
    assert len([c for c in custom if c]) == 13  # every point has a grid in these runs
    assert all((out / unquote(c)).is_file() for c in custom if c)
    assert all(Path(unquote(h.removeprefix("file://"))).exists() for h in links)


def test_no_console_errors(page):
    """Run last in this module: nothing SEVERE logged while loading, hovering and switching."""
    severe = [e["message"] for e in page.get_log("browser") if e["level"] == "SEVERE"]
    assert severe == []
