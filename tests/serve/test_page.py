"""The chat page at ``/`` in headless Chromium (Debian's ``chromium`` + ``chromedriver``, driven by Selenium): type
a message, send it, watch the reply stream in, stop a long one."""
from __future__ import annotations

import shutil
import time

import pytest

from tests.serve.conftest import Server

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="needs Debian's chromium and chromium-driver (.ci/run installs them)")


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        opts.add_argument(a)
    drv = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield drv
    drv.quit()


def wait(fn, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        v = fn()
        if v:
            return v
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_chat_page_streams_and_stops(tmp_path, browser):
    from selenium.webdriver.common.by import By

    from moeq.tiny import make_checkpoint

    s = Server(make_checkpoint("qwen3_moe", tmp_path / "tiny", max_position_embeddings=8192))
    try:
        browser.get(s.url + "/")
        wait(lambda: browser.find_element(By.ID, "model").text == "tiny")
        box = browser.find_element(By.ID, "input")
        box.send_keys("Hello, who are you?")
        browser.find_element(By.ID, "send").click()
        wait(lambda: browser.find_element(By.ID, "status").text == "done")
        msgs = browser.find_elements(By.CSS_SELECTOR, "#log .msg")
        assert [m.get_attribute("class") for m in msgs] == ["msg user", "msg assistant"]
        assert msgs[0].find_element(By.CLASS_NAME, "body").text == "Hello, who are you?"
        first = msgs[1].find_element(By.CLASS_NAME, "body").text
        assert first.strip()  # the streamed reply arrived

        # a reply stopped while it streams (a random model may end a reply early: then the next try)
        body = lambda: browser.find_elements(By.CSS_SELECTOR, "#log .msg .body")[-1].text  # noqa: E731
        status = lambda: browser.find_element(By.ID, "status").text  # noqa: E731
        for _ in range(8):
            box.send_keys("Tell me a very long story")
            browser.find_element(By.ID, "send").click()
            wait(lambda: body() or status() == "done")
            partial = body()
            browser.find_element(By.ID, "stop").click()
            wait(lambda: status() in ("stopped", "done"))
            if status() == "stopped":
                break
        assert status() == "stopped"
        assert body().startswith(partial) and browser.find_element(By.ID, "send").is_enabled()
        # the server dropped the stopped request
        import httpx2 as httpx
        wait(lambda: httpx.get(s.url + "/health").json()["decoding"] == 0, 30)
    finally:
        assert s.stop() == 0, s.output()
