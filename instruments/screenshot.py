"""Screenshots of the chat page of a running `infer.serve`, taken in headless Chromium (Debian's `chromium` and
`chromium-driver`, driven by Selenium): one mid-answer, and one once the answer without speculation is beside it.

    python -m instruments.screenshot --url http://127.0.0.1:8000 --out results/web/demo [--message TEXT]
        [--max-tokens 300] [--after 40] [--width 900]

writes OUT-streaming.png (after --after marked tokens have arrived) and OUT-compared.png.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


def browser(width: int = 900, height: int = 1000):
    """Headless Chromium of the system's packages under Selenium."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={width},{height}"):
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))


def fill(driver, element_id: str, value) -> None:
    """Set an input's value as a user would (select all, type)."""
    from selenium.webdriver.common.keys import Keys

    field = driver.find_element("id", element_id)
    field.send_keys(Keys.CONTROL, "a")
    field.send_keys(str(value))


def wait_for(condition, timeout: float = 120, every: float = 0.02):
    """condition() until it is truthy (returned), or TimeoutError."""
    deadline = time.time() + timeout
    while not (value := condition()):
        if time.time() > deadline:
            raise TimeoutError("the page did not get there in time")
        time.sleep(every)
    return value


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m instruments.screenshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's address (its page is at /)")
    p.add_argument("--out", type=Path, required=True, help="the screenshots' path without the suffix")
    p.add_argument("--message", default="Write a short story about a robot who learns to paint.")
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--after", type=int, default=40, help="marked tokens on the page before the first screenshot")
    p.add_argument("--width", type=int, default=900)
    a = p.parse_args(argv)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    driver = browser(a.width)
    try:
        driver.get(a.url)
        fill(driver, "max-tokens", a.max_tokens)
        driver.find_element("id", "compare").click()
        driver.find_element("id", "prompt").send_keys(a.message + "\n")
        spans = lambda: driver.find_elements("css selector", ".msg.assistant .tok")  # noqa: E731
        wait_for(lambda: len(spans()) >= a.after, every=0.005)
        driver.save_screenshot(str(a.out.with_name(a.out.name + "-streaming.png")))
        wait_for(lambda: driver.find_element("id", "versus").is_displayed() or driver.find_element("id", "error").text)
        driver.save_screenshot(str(a.out.with_name(a.out.name + "-compared.png")))
        print(driver.find_element("id", "stats").text)
    finally:
        driver.quit()


if __name__ == "__main__":
    main()
