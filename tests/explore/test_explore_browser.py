"""`kvwall explore` in a real browser: Debian's headless Chromium driven by Selenium (with Debian's chromedriver).

The page's numbers are checked against kvwall.api (whose ``to_dict()`` is the CLI's ``--json``) and against
`kvwall memory`'s own printed line, with the hand-computed figure where one is short:
Llama-3-70B (80 layers, 8 KV heads of 128; config.json of meta-llama/Meta-Llama-3-70B) in fp8 keeps
2 x 80 x 8 x 128 x 1 B = 163,840 B of KV per token.

Set KVWALL_EXPLORE_SCREENSHOT=docs/img/explore.png to refresh the docs' screenshot.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvwall import api
from kvwall.units import fmt_bytes

pytestmark = [pytest.mark.browser, pytest.mark.slow]  # each test loads the page (~7 s)

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
DRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
MISSING = [p for p in (CHROMIUM, DRIVER) if not os.access(p, os.X_OK)]
if MISSING:
    WHY = f"; {os.environ['KVWALL_NO_BROWSER']}" if os.environ.get("KVWALL_NO_BROWSER") else ""  # set by .ci/run
    pytest.skip(f"no browser: {', '.join(MISSING)} not installed (apt-get install -y chromium chromium-driver; "
                f".ci/run does it as root){WHY}", allow_module_level=True)

from selenium import webdriver  # noqa: E402  (after the skip: only the browser tier needs selenium)
from selenium.webdriver.chrome.options import Options  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

THE_ISSUE = "model=llama-3-70b&device=h100-sxm&tp=4&kv-format=fp8&batch=8&context=128k"
OPTIONS = dict(device="h100-sxm", tp=4, kv_format="fp8", batch=8, context="128k")


@pytest.fixture(scope="module")
def base():
    """`kvwall explore`'s own server (the command's make / listen / server), on a free port, in a thread."""
    from kvwall.commands.explore_cmd import listen, make, server

    sock = listen(0)
    srv = server(make())
    t = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "kvwall explore's server did not start in 30 s"
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    srv.should_exit = True
    t.join(10)


@pytest.fixture(scope="module")
def driver():
    opts = Options()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1400,1900",
                "--no-first-run", "--disable-extensions"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # every request the page makes
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield d
    d.quit()


def ready(driver, query: str | None = None, state: str = "ready", since: int = 0, timeout: float = 30):
    """Wait until the page has drawn the answer to `query` (or shows an error, with state="error"), from an update
    after number `since`."""
    def done(d):
        s = d.find_element(By.ID, "status")
        return (s.get_attribute("data-state") == state and int(s.get_attribute("data-seq") or 0) > since
                and (query is None or s.get_attribute("data-query") == query))
    WebDriverWait(driver, timeout).until(done)


def updates(driver) -> int:
    """How many updates the page has started (the status line's data-seq)."""
    return int(driver.find_element(By.ID, "status").get_attribute("data-seq") or 0)


def value(driver, element_id: str) -> float:
    return float(driver.find_element(By.ID, element_id).get_attribute("data-value"))


def text(driver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def requests_made(driver) -> list[str]:
    """URLs the page asked for since the last call (Chromium's performance log)."""
    urls = []
    for entry in driver.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        if msg["method"] == "Network.requestWillBeSent":
            urls.append(msg["params"]["request"]["url"])
    return urls


def type_into(driver, element_id: str, value: str) -> None:
    el = driver.find_element(By.ID, element_id)
    el.clear()
    el.send_keys(value)


def paste(driver, config: str) -> None:
    """Set the config textarea as a paste does (one input event)."""
    driver.execute_script("const t = document.getElementById('config'); t.value = arguments[0];"
                          "t.dispatchEvent(new Event('input', {bubbles: true}));", config)


def test_the_issues_case_shows_what_kvwall_memory_and_speed_say(base, driver, tmp_path):
    driver.get(base + "/")
    ready(driver)
    requests_made(driver)  # drain the log: only this test's requests count below
    driver.get(base + "/")
    ready(driver)
    Select(driver.find_element(By.ID, "model")).select_by_value("llama-3-70b")
    Select(driver.find_element(By.ID, "device")).select_by_value("h100-sxm")
    type_into(driver, "tp", "4")
    type_into(driver, "kv-format", "fp8")
    type_into(driver, "batch", "8")
    type_into(driver, "context", "128k")
    ready(driver, THE_ISSUE)
    assert driver.current_url == f"{base}/?{THE_ISSUE}"

    mem = api.memory("llama-3-70b", **OPTIONS)
    fit = api.fit("llama-3-70b", device="h100-sxm", tp=4, kv_format="fp8", batch=8)
    sp = api.speed("llama-3-70b", prompt_tokens="2k", **OPTIONS).models[0]
    assert value(driver, "bytes-per-token") == mem.cache_bytes_per_token == 2 * 80 * 8 * 128 * 1
    assert text(driver, "bytes-per-token") == "160 KiB (163,840 B)"
    for element_id, expected in (("weights-gpu", mem.per_gpu_weights_bytes), ("cache-gpu", mem.per_gpu_cache_bytes),
                                  ("total-gpu", mem.per_gpu_bytes)):
        assert value(driver, element_id) == expected
        assert text(driver, element_id) == fmt_bytes(expected)
    # 4 GPUs: the 8 KV heads split 2 per GPU, so each holds a quarter of the cache: 8 x 131,072 x 40,960 B
    assert mem.per_gpu_cache_bytes == 8 * 131_072 * 163_840 // 4
    assert value(driver, "max-context") == fit.max_context
    assert value(driver, "ttft") == sp.ttft_s
    assert value(driver, "tpot") == sp.points[0].tpot_s
    assert value(driver, "tokens-per-s") == sp.points[0].tokens_per_s
    # 72.9 GiB per GPU against 72 GB usable (80 GB less 10 %): the page says what `kvwall memory` prints
    cli = subprocess.run([sys.executable, "-m", "kvwall", "memory", "llama-3-70b", "--device", "h100-sxm", "--tp", "4",
                          "--kv-format", "fp8", "--batch", "8", "--context", "128k"], capture_output=True, text=True,
                         env=os.environ | {"COLUMNS": "200"}, check=True).stdout
    verdict = text(driver, "fit-verdict")
    assert verdict == "on h100-sxm (80 GB per GPU, 10% kept in reserve): does NOT fit, 5.8 GiB short"
    assert verdict in cli
    assert f"{sp.points[0].tokens_per_s:,.1f} (!)" == text(driver, "tokens-per-s")  # the speed table's cell
    assert "does not fit h100-sxm" in text(driver, "warnings")
    assert ("kvwall memory llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --batch 8 --context 128k"
            in text(driver, "commands").splitlines())
    for chart in ("chart-memory", "chart-speed", "chart-ttft", "chart-roofline"):  # plotly drew each
        assert driver.find_elements(By.CSS_SELECTOR, f"#{chart} .main-svg"), chart
    rows = driver.find_elements(By.CSS_SELECTOR, "#layers tbody tr")
    assert [r.text for r in rows] == ["attention 80 40,960 40 GiB 0 B"]  # per GPU: 163,840 / 4 B per token

    shot = Path(os.environ.get("KVWALL_EXPLORE_SCREENSHOT") or tmp_path / "explore.png")
    driver.save_screenshot(str(shot))
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    urls = requests_made(driver)
    assert f"{base}/static/plotly.min.js" in urls  # the log sees the page's requests ...
    outside = [u for u in urls if not u.startswith((base + "/", "data:", "blob:", "about:"))]
    assert outside == []  # ... and none leaves kvwall's own server


def test_the_url_restores_the_view(base, driver):
    driver.get(f"{base}/?{THE_ISSUE}&model=llama-3-8b&rate=1")
    query = "model=llama-3-70b&model=llama-3-8b&device=h100-sxm&tp=4&kv-format=fp8&batch=8&context=128k&rate=1"
    ready(driver, query)
    assert Select(driver.find_element(By.ID, "model")).first_selected_option.get_attribute("value") == "llama-3-70b"
    assert [o.get_attribute("value") for o in Select(driver.find_element(By.ID, "compare")).all_selected_options] \
        == ["llama-3-8b"]
    for element_id, expected in (("tp", "4"), ("kv-format", "fp8"), ("batch", "8"), ("context", "128k")):
        assert driver.find_element(By.ID, element_id).get_attribute("value") == expected
    assert text(driver, "link") == f"{base}/?{query}"
    assert value(driver, "total-gpu") == api.memory("llama-3-70b", **OPTIONS).per_gpu_bytes
    rows = driver.find_elements(By.CSS_SELECTOR, "#compare-table tbody tr")
    small = api.memory("llama-3-8b", **OPTIONS)
    assert [r.text.split()[0] for r in rows] == ["llama-3-70b", "llama-3-8b"]
    assert fmt_bytes(small.per_gpu_bytes) in rows[1].text
    sim = api.simulate("llama-3-70b", rate=1, requests=200, prompt_tokens=2048, output_tokens=128, device="h100-sxm",
                       tp=4, kv_format="fp8").points[0]
    assert driver.find_element(By.ID, "sim-KV-pool").text.startswith(f"{sim.kv_blocks:,} blocks of 16 tokens")
    assert "kvwall simulate llama-3-70b --device h100-sxm --tp 4 --kv-format fp8 --rate 1 --requests 200" \
        in text(driver, "commands")


def test_a_pasted_config_and_the_errors_for_a_bad_one(base, driver):
    from transformers import LlamaConfig

    driver.get(f"{base}/?model=llama-3-8b&device=h100-sxm&tp=1&kv-format=fp8&batch=2&context=4k")
    ready(driver)
    cfg = LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, head_dim=32, vocab_size=1000).to_dict()
    paste(driver, json.dumps(cfg))
    query = "device=h100-sxm&tp=1&kv-format=fp8&batch=2&context=4k"
    ready(driver, query)
    assert value(driver, "bytes-per-token") == 2 * 4 * 2 * 32 * 1  # K and V, 4 layers, 2 KV heads of 32, fp8
    assert value(driver, "cache-gpu") == 2 * 4096 * 512
    assert "kvwall memory config.json --device h100-sxm --tp 1 --kv-format fp8 --batch 2 --context 4k" \
        in text(driver, "commands").splitlines()
    assert not driver.find_element(By.ID, "error").is_displayed()

    n = updates(driver)
    paste(driver, '{"model_type": "llama", "hidden_size": 256')  # cut short
    ready(driver, state="error", since=n)
    error = text(driver, "error")
    assert error.startswith("kvwall: error: the pasted config.json is not valid JSON (line 1, column")
    n = updates(driver)
    paste(driver, json.dumps({k: v for k, v in cfg.items() if k != "num_attention_heads"}))
    ready(driver, state="error", since=n)
    error = text(driver, "error")
    assert "num_attention_heads" in error and "\n" not in error and "Traceback" not in error
    n = updates(driver)
    paste(driver, json.dumps(cfg))
    type_into(driver, "batch", "0")
    ready(driver, state="error", since=n)
    assert text(driver, "error") == "kvwall: error: batch must be at least 1 (got 0)"
    outside = [u for u in requests_made(driver) if not u.startswith((base + "/", "data:", "blob:", "about:"))]
    assert outside == []


def test_the_pages_formatting_is_the_clis(base, driver):
    """The page formats in JavaScript what kvwall.units formats in Python; the same text for the same number,
    ties included (72.25 GiB: Python's round-half-even says 72.2, JavaScript's toFixed 72.3)."""
    from kvwall.units import fmt_tokens

    if driver.execute_script("return typeof fmtBytes") != "function":
        driver.get(base + "/")
        ready(driver)
    sizes = [0, 1, 1023, 1024, 1536, 70_272, 163_840, 72.25 * 2**30, 5.75 * 2**30, 1.05 * 2**40, 123_456_789_012_345,
             2**60 * 3, -6_228_504_576]
    assert driver.execute_script("return arguments[0].map((n) => fmtBytes(n))", sizes) == [fmt_bytes(n) for n in sizes]
    counts = [1, 1000, 1024, 5000, 131_072, 1_048_576, 1_572_864, 3 << 20]
    assert driver.execute_script("return arguments[0].map((n) => fmtTokens(n))", counts) == \
        [fmt_tokens(n) for n in counts]


def test_weights_that_do_not_fit_say_so(base, driver):
    driver.get(f"{base}/?model=llama-3.1-405b&device=h100-sxm&tp=1&batch=1&context=4k")
    ready(driver, "model=llama-3.1-405b&device=h100-sxm&tp=1&batch=1&context=4k")
    mem = api.memory("llama-3.1-405b", device="h100-sxm", context="4k")
    assert text(driver, "max-context") == "none: the weights do not fit"
    assert text(driver, "fit-verdict").startswith("on h100-sxm (80 GB per GPU, 10% kept in reserve): does NOT fit, ")
    assert value(driver, "total-gpu") == mem.per_gpu_bytes
    notes = api.roofline("llama-3.1-405b", device="h100-sxm", context="4k").notes
    assert notes and notes[-1] in text(driver, "warnings")  # the CLI's own hint: add --tp/--pp or a smaller format
