"""The UI in a real browser: Debian's chromium, headless, driven by selenium through chromium-driver (both installed
by .ci/run; nothing is downloaded). Log in, open the run, see the reward curve drawn with one point per step and
updated live when the trainer logs another, open a trajectory, see its tool calls and its tokens coloured and as
text, open a tree-shaped trajectory and see its call tree drawn. Screenshots are saved under the test's tmp dir (and
under $TRAJGATE_UI_SCREENSHOTS if set); the README's come from the CPU demo (scripts/ui_screenshots.py)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.store import db
from tests.support.fake_upstream import FakeUpstream
from tests.support.gateway_harness import RunningGateway, running_gateway
from tests.support.ui_seed import RUN, STEP_METRICS, TOKEN_TEXT_IDS, TOKEN_TEXTS, TREE_TRAJECTORY, add_step, seed

CHROMIUM = shutil.which("chromium")
CHROMEDRIVER = shutil.which("chromedriver")
ADMIN = "browser-admin-key"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None or CHROMEDRIVER is None,
    reason="needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver; .ci/run does)",
)


@pytest.fixture
def seeded_gateway(upstream: FakeUpstream, tmp_path: Path) -> Iterator[tuple[RunningGateway, str]]:
    url = f"sqlite:///{tmp_path / 'trajgate.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    try:
        seed(engine)
    finally:
        engine.dispose()
    with running_gateway(
        database_url=url, upstream_url=upstream.base_url, base_model="smollm2", spool_dir=tmp_path / "spool",
        admin_key=ADMIN,
    ) as gw:  # fmt: skip
        yield gw, url


@pytest.fixture
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1280,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def _shoot(driver: object, tmp_path: Path, name: str) -> Path:
    """Save a screenshot of the whole page as a test artifact (and a copy for the README when asked)."""
    from selenium.webdriver.common.by import By

    body = driver.find_element(By.TAG_NAME, "body")  # type: ignore[attr-defined]
    height = driver.execute_script("return document.body.scrollHeight")  # type: ignore[attr-defined]
    driver.set_window_size(1280, min(max(height, 600), 1600))  # type: ignore[attr-defined]
    path = tmp_path / "artifacts" / f"{name}.png"
    path.parent.mkdir(exist_ok=True)
    assert body.screenshot(str(path))
    wanted = os.environ.get("TRAJGATE_UI_SCREENSHOTS")
    if wanted:
        Path(wanted).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(wanted) / path.name)
    return path


def test_login_run_curve_and_trajectory(
    seeded_gateway: tuple[RunningGateway, str], browser: object, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    gw, url = seeded_gateway
    driver = browser
    wait = WebDriverWait(driver, 20)  # type: ignore[arg-type]

    driver.get(gw.url + f"/ui/run?name={RUN}")  # type: ignore[attr-defined]
    wait.until(ec.presence_of_element_located((By.ID, "key")))  # sent to the login form, asked for the key
    driver.find_element(By.ID, "key").send_keys(ADMIN)  # type: ignore[attr-defined]
    driver.find_element(By.ID, "login").click()  # type: ignore[attr-defined]

    # back on the run page, with the curve drawn by our script: one train point per step, one eval point per version
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#reward-chart circle.pt.train")) == len(STEP_METRICS))
    assert len(driver.find_elements(By.CSS_SELECTOR, "#reward-chart circle.pt.eval")) == 2  # type: ignore[attr-defined]
    assert driver.find_elements(By.CSS_SELECTOR, "#reward-chart polygon.band")  # type: ignore[attr-defined]
    loss = driver.find_elements(By.CSS_SELECTOR, '.chart[data-metric="loss"] circle.pt')  # type: ignore[attr-defined]
    assert len(loss) == len(STEP_METRICS)

    # live: the trainer logs step 3 and the open page draws it without a reload
    wait.until(lambda d: d.find_element(By.ID, "live-status").text == "live")
    engine = db.make_engine(url)
    try:
        add_step(engine, 3, 0.875)
    finally:
        engine.dispose()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "#reward-chart circle.pt.train")) == 3)
    assert driver.find_element(By.CSS_SELECTOR, "#steps-table tbody tr").get_attribute("data-step") == "3"  # type: ignore[attr-defined]
    assert _shoot(driver, tmp_path, "run").stat().st_size > 10_000

    driver.get(gw.url + "/ui/trajectory?id=g0-t0")  # type: ignore[attr-defined]
    wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, ".tool-call")))
    calls = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".tool-call")]  # type: ignore[attr-defined]
    assert any(text.startswith("→ search(") for text in calls), calls
    tokens = driver.find_elements(By.CSS_SELECTOR, ".tokens .tok")  # type: ignore[attr-defined]
    assert len(tokens) == 11
    # as text (vLLM's derender, replayed), a token that is part of a character as '·'; the id and logprob on hover
    shown = [t.get_attribute("textContent") for t in tokens]
    assert shown == [text or "·" for texts in TOKEN_TEXTS for text in texts]
    assert tokens[0].get_attribute("title").startswith(f"id {TOKEN_TEXT_IDS[0][0]} · logprob")
    colours = {t.value_of_css_property("background-color") for t in tokens}
    assert len(colours) >= 2  # coloured by logprob, not one flat colour
    assert all(t.value_of_css_property("border-bottom-style") == "solid" for t in tokens)  # trained: solid underline
    assert _shoot(driver, tmp_path, "trajectory").stat().st_size > 10_000

    # the call tree: a node per call, an edge per parent; a node takes you to its call
    driver.get(gw.url + f"/ui/trajectory?id={TREE_TRAJECTORY}")  # type: ignore[attr-defined]
    wait.until(ec.presence_of_element_located((By.ID, "call-tree")))
    nodes = driver.find_elements(By.CSS_SELECTOR, "#call-tree circle.tree-node")  # type: ignore[attr-defined]
    edges = driver.find_elements(By.CSS_SELECTOR, "#call-tree path.tree-edge")  # type: ignore[attr-defined]
    assert len(nodes) == 5 and len(edges) == 3
    assert all(e.size["height"] > 0 for e in edges)  # drawn, not just present
    assert len(driver.find_elements(By.CSS_SELECTOR, "#call-tree circle.tree-node.fork")) == 1  # type: ignore[attr-defined]
    labels = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#call-tree text.tree-label")]  # type: ignore[attr-defined]
    assert labels[1] == "turn 1 · new root: new_root" and labels[3] == "turn 3 · fork of turn 0"
    driver.find_elements(By.CSS_SELECTOR, "#call-tree text.tree-label")[3].click()  # type: ignore[attr-defined]
    wait.until(lambda d: d.execute_script("return location.hash") == "#turn-3-0")
    assert _shoot(driver, tmp_path, "tree").stat().st_size > 10_000
