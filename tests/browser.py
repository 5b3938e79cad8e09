"""A real Chromium, driven by Selenium, for the playground's tests and its screenshots.

Debian's `chromium` and `chromium-driver` (`.ci/run` installs them): browser downloads do not work on our
machines, so Selenium is pointed at the system's browser and driver, and never fetches its own.

`python -m tests.browser --url http://127.0.0.1:8000 --out docs/playground --sizes desktop` takes the
README's screenshots of a running server's playground, after a chat and a comparison (a server started
afresh for each width: its suffix drafter would draft the second from the first's answers).
"""

from __future__ import annotations

import argparse
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
MISSING = None if BROWSER and DRIVER else "no Chromium here: apt-get install -y chromium chromium-driver"
DESKTOP, PHONE = (1280, 900), (390, 844)  # CSS pixels; the phone's is an iPhone 12-14's


@contextmanager
def chromium(size: tuple[int, int] = DESKTOP) -> Iterator[WebDriver]:
    """A headless Chromium of the system's, closed when the block ends."""
    options = webdriver.ChromeOptions()
    options.binary_location = BROWSER
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                     "--force-device-scale-factor=1", f"--window-size={size[0]},{size[1]}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(DRIVER), options=options)
    try:
        driver.set_window_size(*size)
        yield driver
    finally:
        driver.quit()


def wait(driver: WebDriver, condition, what: str, limit_s: float = 120.0):
    """Until condition(driver) is truthy; the limit only bounds a broken run, nothing asserts on time."""
    return WebDriverWait(driver, limit_s, poll_frequency=0.05).until(condition, f"gave up waiting for {what}")


def open_page(driver: WebDriver, url: str) -> None:
    """The playground at `url`, once it has read the model's name."""
    driver.get(url)
    wait(driver, lambda d: d.find_element(By.ID, "server-line").text.startswith("Model "), "the page to connect")


def send(driver: WebDriver, text: str) -> None:
    """Type a message and send it with Enter, as a person would."""
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(text)
    box.send_keys("\n")


def idle(driver: WebDriver) -> bool:
    """Whether no request is in flight (Stop is disabled)."""
    return not driver.find_element(By.ID, "stop").is_enabled()


SIZES = {"desktop": DESKTOP, "phone": PHONE}


def screenshots(url: str, out: Path, prompt: str, follow_up: str, sizes: list[str]) -> list[Path]:
    """The page after a chat (`prompt`) and a comparison (`follow_up`, in that conversation): the whole page at
    desktop width, the first screen at phone width."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in sizes:
        size = SIZES[name]
        with chromium(size) as driver:
            open_page(driver, url)
            send(driver, prompt)
            wait(driver, lambda d: idle(d) and d.find_elements(By.CSS_SELECTOR, "#conversation .tok"), "the reply", 600)
            driver.find_element(By.ID, "prompt").send_keys(follow_up)
            driver.find_element(By.ID, "compare").click()
            verdict = lambda d: "seed" in d.find_element(By.ID, "comparison-verdict").text and idle(d)  # noqa: E731
            wait(driver, verdict, "the comparison", 600)
            if name == "desktop":  # the whole page in one picture; a phone's is what one screen shows
                height = driver.execute_script("return document.documentElement.scrollHeight")
                driver.set_window_size(size[0], height + 100)
            driver.execute_script("window.scrollTo(0, 0)")
            path = out / f"playground-{name}.png"
            driver.save_screenshot(str(path))
            paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running server (its playground is at /)")
    parser.add_argument("--out", type=Path, default=Path("docs/playground"), help="where the PNGs go")
    parser.add_argument("--prompt", default="Write a Python function that returns the squares of a list of numbers.")
    parser.add_argument("--follow-up", default="Now add type hints and a docstring to it.",
                        help="the next message, decoded both ways by Compare")
    parser.add_argument("--sizes", default=",".join(SIZES),
                        help="which widths (the suffix drafter remembers the first run: serve afresh for each)")
    args = parser.parse_args(argv)
    if MISSING:
        parser.error(MISSING)
    for path in screenshots(args.url, args.out, args.prompt, args.follow_up, args.sizes.split(",")):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
