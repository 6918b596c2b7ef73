"""The web UI screenshots in the README and docs/operations.md, taken from a real run's database (the CPU demo's).

Serves the UI on DATABASE with `trajgate serve` (an admin key set, so the pages look as they do in production),
logs in through the form in Debian's headless chromium (selenium + chromium-driver, nothing downloaded), and saves
the run page and one trajectory page as small palette PNGs. The trajectory shown is the run's trained train-mode
trajectory with the most calls (the highest reward among those). Token text comes from the vLLM at --upstream
(its completions derender, gateway.ui.token_text): without one the page shows token ids.

    python -m gateway.cli demo --task tools --steps 2 ... --workdir /tmp/demo
    python -m trainer.demo.vllm_cpu serve --model smollm2 --tools --port 8001 &
    python scripts/ui_screenshots.py --database sqlite:////tmp/demo/trajgate.db --upstream http://127.0.0.1:8001/v1
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from sqlalchemy import func, select  # noqa: E402

from gateway.store import db  # noqa: E402
from gateway.store.models import Call, Trajectory  # noqa: E402

ADMIN = "screenshot-admin-key"
WIDTH = 1200
MAX_HEIGHT = 1700


def pick_trajectory(database_url: str, run: str) -> str:
    """The run's trained train-mode trajectory with the most calls, the best rewarded among them."""
    engine = db.make_engine(database_url)
    try:
        with engine.connect() as conn:
            calls = func.count(Call.id).label("calls")
            row = conn.execute(
                select(Trajectory.trajectory_id, calls)
                .join(Call, Call.trajectory_id == Trajectory.trajectory_id)
                .where(Trajectory.run == run, Trajectory.mode == "train", Trajectory.trained_step.is_not(None))
                .group_by(Trajectory.trajectory_id, Trajectory.reward)
                .order_by(calls.desc(), Trajectory.reward.desc(), Trajectory.trajectory_id)
                .limit(1)
            ).first()
    finally:
        engine.dispose()
    if row is None:
        raise SystemExit(f"run {run!r} has no trained trajectory in {database_url}")
    return str(row.trajectory_id)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise SystemExit(f"the gateway at {url} did not start in {timeout_s:g} s")


def save_small(png: bytes, path: Path) -> int:
    """The screenshot as a 256-colour palette PNG: the UI's flat colours survive, the file is a third the size."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.FASTOCTREE)
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path, optimize=True)
    return path.stat().st_size


def shoot(database_url: str, upstream: str, run: str, out_dir: Path) -> list[tuple[Path, int]]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    chromium, chromedriver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or chromedriver is None:
        raise SystemExit("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    trajectory = pick_trajectory(database_url, run)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spool = Path(tempfile.mkdtemp(prefix="trajgate-shots-"))
    env = {**os.environ, "TRAJGATE_DATABASE_URL": database_url, "TRAJGATE_UPSTREAM_URL": upstream,
           "TRAJGATE_BASE_MODEL": "smollm2", "TRAJGATE_ADMIN_KEY": ADMIN, "TRAJGATE_AGENT_KEYS": "",
           "TRAJGATE_SPOOL_DIR": str(spool), "PYTHONPATH": str(REPO_ROOT)}  # fmt: skip
    gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve", "--port", str(port)], env=env)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars",
                 f"--window-size={WIDTH},900"):  # fmt: skip
        options.add_argument(flag)
    driver = None
    saved = []
    try:
        wait_ready(url)
        driver = webdriver.Chrome(service=Service(executable_path=chromedriver), options=options)
        wait = WebDriverWait(driver, 30)
        driver.get(f"{url}/ui/run?name={urllib.parse.quote(run)}")
        wait.until(ec.presence_of_element_located((By.ID, "key")))
        driver.find_element(By.ID, "key").send_keys(ADMIN)
        driver.find_element(By.ID, "login").click()
        wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#reward-chart circle.pt"))
        pages = [("ui-run", None), ("ui-trajectory", f"{url}/ui/trajectory?id={urllib.parse.quote(trajectory)}")]
        for name, page in pages:
            if page is not None:
                driver.get(page)
                wait.until(ec.presence_of_element_located((By.ID, "call-tree")))
            height = driver.execute_script("return document.body.scrollHeight")
            driver.set_window_size(WIDTH, min(max(height, 600), MAX_HEIGHT))
            time.sleep(0.5)  # the run page redraws its charts on resize
            path = out_dir / f"{name}.png"
            saved.append((path, save_small(driver.get_screenshot_as_png(), path)))
    finally:
        if driver is not None:
            driver.quit()
        gateway.terminate()
        gateway.wait(20)
        shutil.rmtree(spool, ignore_errors=True)
    return saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--database", required=True, help="the run's database URL (the demo's: sqlite:///WORKDIR/trajgate.db)")
    parser.add_argument("--upstream", required=True, help="a vLLM serving SmolLM2 as smollm2 with --enable-scale-out")
    parser.add_argument("--run", default="demo")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "docs")
    args = parser.parse_args()
    for path, size in shoot(args.database, args.upstream, args.run, args.out):
        print(f"{path}: {size // 1024} KiB")


if __name__ == "__main__":
    main()
