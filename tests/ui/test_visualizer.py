"""The visualizer page in a real browser against a real server with an API key.

Playwright for Python drives Debian's Chromium (/usr/bin/chromium, installed by `make setup`;
never `playwright install`). Screenshots of each stage go to docs/ui/ (one is in the README).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import httpx
import pytest

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "ui"
KEY = "sk-ui-test-key"
PROMPT = "什么是 LLM 推理？"  # the seed's example
MAX_TOKENS = 16
LAUNCH_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
MS = re.compile(r"^\d+(\.\d+)? ms$")

sync_api = pytest.importorskip("playwright.sync_api")
if not CHROMIUM.exists():
    pytest.skip(
        "needs Debian's chromium at /usr/bin/chromium (make setup installs it)", allow_module_level=True
    )


@pytest.fixture(scope="module")
def server(make_server):
    # fp32: the page's two runs (cold, then from the prefix cache) and the API's reference run
    # compute the prompt in different chunk shapes; in bf16 those round differently and can flip
    # a greedy near-tie of this small model, which would be a numerics artefact, not a UI bug.
    return make_server(["--no-access-log", "--dtype", "float32"], env={"FORNAX_API_KEY": KEY}, api_key=KEY)


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=LAUNCH_ARGS, headless=True)
        yield browser
        browser.close()


def _messages() -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPT}]


def _attrs(page, selector: str, expr: str) -> list:
    """`expr` (JS, of element `e`) for every element matching `selector`."""
    return page.eval_on_selector_all(selector, f"els => els.map(e => {expr})")


def _background_request(server, i: int) -> None:
    # Long enough to be still running when the page's own request is scheduled, on a loaded
    # machine too (48 tokens were done before Play's request arrived while a compiler ran).
    body = {"prompt": f"Story {i}: once upon a time", "max_tokens": 160, "temperature": 0, "ignore_eos": True}
    httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120, json=body)


def _wait_running(server, n: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while server.state()["num_running"] < n:
        assert time.monotonic() < deadline, "background requests never ran"
        time.sleep(0.05)


def _live(server) -> dict:
    return httpx.get(server.url + "/v1/fornax/live?once=true", headers=server.headers, timeout=30).json()


def _shown_text(page) -> str:
    return page.eval_on_selector("#output-text", "e => e.textContent")


def _play(page, timeout_ms: int = 120_000) -> None:
    page.fill("#prompt", PROMPT)
    page.fill("#temperature", "0")
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.click("#play")
    # Done when the engine's `finished` event and the stream's end have both been shown.
    page.wait_for_function(
        "document.getElementById('finish').textContent !== '–' && !document.getElementById('play').disabled",
        timeout=timeout_ms,
    )


def test_visualizer_follows_a_real_request(server, browser):
    SHOTS.mkdir(parents=True, exist_ok=True)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/ui/")

    # With auth on: the page asks for a key; a wrong one shows an error, not a blank page.
    page.wait_for_selector("#auth:not([hidden])")
    page.fill("#api-key", "sk-wrong")
    page.click("#auth-form button")
    page.wait_for_selector("#error:not([hidden])")
    assert "API key" in page.inner_text("#error")
    assert page.is_disabled("#play")
    page.screenshot(path=str(SHOTS / "auth-error.png"))

    page.fill("#api-key", KEY)
    page.click("#auth-form button")
    page.wait_for_selector("#conn[data-state='ok']")
    assert page.is_hidden("#error") and page.is_enabled("#play")

    # 1. Tokenize: the chips are exactly /tokenize's ids, and the template's tokens are marked.
    _play(page)
    body = {"messages": _messages(), "add_generation_prompt": True}
    expected = httpx.post(server.url + "/tokenize", headers=server.headers, timeout=30, json=body)
    expected = expected.json()["tokens"]
    chips = [int(x) for x in _attrs(page, "#token-chips .chip", "e.dataset.id")]
    assert chips == expected
    assert page.inner_text("#token-count") == str(len(expected))
    assert page.inner_text("#numerics").startswith("batch-dependent")  # served without --deterministic
    num_template = page.locator("#token-chips .chip.template").count()
    assert 0 < num_template < len(expected)

    # 4. Output: the streamed text is the API's greedy answer, token latencies are shown.
    greedy = httpx.post(
        server.url + "/v1/chat/completions",
        headers=server.headers,
        timeout=120,
        json={
            "messages": _messages(),
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
        },
    ).json()["choices"][0]
    assert _shown_text(page) == greedy["message"]["content"]
    assert page.inner_text("#finish") == greedy["finish_reason"]
    assert MS.match(page.inner_text("#ttft")), page.inner_text("#ttft")
    out_tokens = page.locator("#output-tokens .chip")
    assert out_tokens.count() == MAX_TOKENS or greedy["finish_reason"] == "stop"
    itls = _attrs(page, "#output-tokens .chip", "e.dataset.itl ?? null")
    assert itls[0] is None and all(float(x) > 0 for x in itls[1:])
    subs = _attrs(page, "#output-tokens .chip small", "e.textContent")
    assert subs[0] == "TTFT" and all(MS.match(s) for s in subs[1:])
    assert all("logprob" in title for title in _attrs(page, "#output-tokens .chip", "e.title"))
    assert page.locator("#chunks li").count() >= 1
    assert page.locator("#blocks .block").count() >= 1 and page.locator("#blocks .block.cached").count() == 0
    page.wait_for_function("document.getElementById('live-running').textContent !== '–'")
    for stage in ("tokenize", "schedule", "prefill", "output"):
        page.locator(f"#stage-{stage}").screenshot(path=str(SHOTS / f"stage-{stage}.png"))

    # 2. Schedule, again: the same prompt now finds its full blocks in the prefix cache, and it
    # joins a batch with two other live requests (fp32 keeps its greedy text the same).
    others = [threading.Thread(target=_background_request, args=(server, i), daemon=True) for i in range(2)]
    for t in others:
        t.start()
    _wait_running(server, 2)
    _play(page)
    cached = page.locator("#blocks .block.cached").count()
    assert cached >= 2, page.inner_html("#blocks")
    assert page.locator("#prefill-bar .seg.cached").count() == 1
    assert _shown_text(page) == greedy["message"]["content"]
    assert page.locator("#batch .chip").count() >= 2, page.inner_html("#batch")  # itself + others
    page.locator("#stage-schedule").screenshot(path=str(SHOTS / "stage-schedule-prefix-cache.png"))
    page.wait_for_timeout(1500)  # one more live snapshot, so the charts show the two runs
    page.screenshot(path=str(SHOTS / "visualizer.png"), full_page=True)
    for t in others:
        t.join(timeout=120)

    # A phone-sized screen: one column, nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    page.wait_for_timeout(300)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth + 1")
    page.screenshot(path=str(SHOTS / "phone.png"), full_page=True)
    page.close()
    # Each Play's event streams are closed with it: no subscriber is left keeping the bus busy.
    deadline = time.monotonic() + 10
    while _live(server)["watchers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live(server)["watchers"] == 0


def test_event_endpoints(server):
    for path in ("/v1/fornax/events", "/v1/fornax/live?once=true"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
    live = _live(server)
    assert {"num_running", "num_waiting", "kv_cache_usage", "series"} <= live.keys()
    assert httpx.get(server.url + "/ui/", timeout=10).status_code == 200  # the page itself is public

    # A watcher keeps the bus active; a request's subscriber that comes after it has finished
    # still gets its whole story from the history, and the stream ends after `finished`.
    opened = threading.Event()

    def watch() -> None:
        with httpx.stream("GET", server.url + "/v1/fornax/events", headers=server.headers, timeout=60) as r:
            for _ in r.iter_lines():
                opened.set()
                if done.is_set():
                    return

    done = threading.Event()
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert opened.wait(30)
    body = {"prompt": "The tides are", "max_tokens": 3, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=60, json=body).json()
    with httpx.stream(
        "GET",
        server.url + "/v1/fornax/events",
        params={"request_id": answer["id"]},
        headers=server.headers,
        timeout=60,
    ) as r:
        events = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:")]
    done.set()
    types = [e["type"] for e in events]
    assert types[:3] == ["queued", "scheduled", "blocks"] and types[-1] == "finished", types
    assert types.count("token") == 3 and "prefill_chunk" in types
    # Wake the watcher (it returns at its next line) so the server ends idle.
    httpx.post(
        server.url + "/v1/completions",
        headers=server.headers,
        timeout=60,
        json={"prompt": "Hi", "max_tokens": 1},
    )
    watcher.join(timeout=30)


# ---- through a router --------------------------------------------------------------------------


@pytest.fixture
def router(server, tmp_path):
    """A real `fornax router` in front of the test server, known to it twice (by 127.0.0.1,
    the page's origin, and by localhost, which the page takes for another replica), plus a
    replica that never answers. Round-robin, so the page's two requests go one to each."""
    from tests.support import free_port

    port, dead = free_port(), free_port()
    replicas = [server.url, server.url.replace("127.0.0.1", "localhost"), f"http://127.0.0.1:{dead}"]
    cmd = [
        sys.executable,
        "-m",
        "fornax.router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--policy",
        "round-robin",
        "--admin-key",
        KEY,
        "--replica-poll-key",
        KEY,
        "--poll-interval",
        "0.5",
        "--no-access-log",
    ]
    for url in replicas:
        cmd += ["--replica", url]
    log = (tmp_path / "router.log").open("w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_replicas_in_rotation(url, replicas[:2], proc)
        yield url, replicas
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


ADMIN = {"Authorization": f"Bearer {KEY}"}


def _wait_replicas_in_rotation(url: str, expected: list[str], proc, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, "the router exited"
        try:
            data = httpx.get(url + "/router/replicas", headers=ADMIN, timeout=2).json()
            if {r["url"] for r in data["data"] if r["healthy"] and r["ready"]} >= set(expected):
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, "the router never took the replicas into rotation"
        time.sleep(0.1)


def test_visualizer_through_a_router(server, browser, router):
    router_url, (mine, other, dead) = router
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/ui/?router=" + router_url)
    page.wait_for_selector("#auth:not([hidden])")
    page.fill("#api-key", KEY)  # one key: the router's admin key, passed on to the replica
    page.click("#auth-form button")
    page.wait_for_selector("#conn[data-state='ok']")
    assert page.is_visible("#router") and page.input_value("#router-url") == router_url

    # The replica list, polled from /router/replicas: both names of the server in rotation, one out.
    page.wait_for_function("document.querySelectorAll('#router-replicas tr').length === 3")
    page.wait_for_function("!document.querySelector('#router-replicas tr[data-state=\"not ready\"]')")
    states = dict(
        zip(
            _attrs(page, "#router-replicas tr", "e.dataset.url"),
            _attrs(page, "#router-replicas tr", "e.dataset.state"),
            strict=True,
        )
    )
    assert states == {mine: "in rotation", other: "in rotation", dead: "out"}
    assert "round-robin" in page.inner_text("#router-note")

    # 1st request: the router picks this page's replica, so the stages follow it as without one.
    _play(page)
    assert page.inner_text("#route-replica") == mine + " (this page's replica)"
    assert page.inner_text("#route-reason").startswith("round_robin")
    assert page.inner_text("#route-attempts") == "1"
    assert page.is_hidden("#route-elsewhere") and page.is_hidden("#error")
    assert page.locator("#output-tokens .chip").count() >= 1 and page.locator("#blocks .block").count() >= 1
    assert _attrs(page, "#router-replicas tr.me", "e.dataset.url") == [mine]
    # The list keeps being polled: the router's in-flight count on this replica drops back to 0.
    page.wait_for_function(
        "document.querySelector('#router-replicas tr.me td:nth-child(3)').textContent === '0'"
    )
    page.locator("#live").screenshot(path=str(SHOTS / "router.png"))

    # 2nd request: another replica (as far as the page can tell) runs it. The text still streams
    # through the router; the engine events are that replica's, and the page says where to look.
    _play(page)
    assert page.inner_text("#route-replica") == other
    assert _shown_text(page) and page.is_hidden("#error")
    assert page.locator("#output-tokens .chip").count() == 0
    link = page.get_attribute("#route-elsewhere a", "href")
    assert link == other + "/ui/?router=" + quote(router_url, safe="")
    page.close()
    deadline = time.monotonic() + 10  # the aborted firehose is closed too
    while _live(server)["watchers"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _live(server)["watchers"] == 0

    # CORS is for the replicas' pages only: any other site's page gets nothing to read.
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    foreign = httpx.options(
        router_url + "/v1/chat/completions",
        timeout=10,
        headers={"Origin": "http://elsewhere.example", **preflight},
    )
    assert "access-control-allow-origin" not in foreign.headers
    allowed = httpx.options(
        router_url + "/router/replicas", timeout=10, headers={"Origin": mine, **preflight}
    )
    assert allowed.status_code == 204 and allowed.headers["access-control-allow-origin"] == mine


def test_visualizer_picks_the_model(make_server, browser, gemma3_gguf):
    """A server with two models: the page lists both, and the one picked answers (Gemma 3, the
    seed's Chinese prompt; screenshot docs/ui/gemma3.png)."""
    server = make_server(
        [
            "--model",
            "smollm2-135m-instruct",
            "--model",
            "gemma3-270m",
            "--max-model-len",
            "2048",
            "--no-access-log",
        ]
    )
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(server.url + "/ui/")
    page.wait_for_function("document.getElementById('model').options.length === 2")
    assert _attrs(page, "#model option", "e.value") == ["smollm2-135m-instruct", "gemma3-270m"]
    page.select_option("#model", "gemma3-270m")
    page.fill("#max-tokens", "48")
    page.fill("#prompt", PROMPT)
    page.fill("#temperature", "0")
    page.click("#play")
    page.wait_for_function(
        "document.getElementById('finish').textContent !== '–' && !document.getElementById('play').disabled",
        timeout=120_000,
    )
    reference = httpx.post(
        server.url + "/v1/chat/completions",
        timeout=120,
        json={
            "model": "gemma3-270m",
            "messages": _messages(),
            "temperature": 0,
            "max_tokens": 48,
        },
    ).json()["choices"][0]["message"]["content"]
    assert _shown_text(page) == reference and reference
    # the prompt's tokens are Gemma's (its chat template's turn markers among them)
    chips = _attrs(page, "#token-chips .chip", "e.dataset.id")
    gemma = httpx.post(
        server.url + "/tokenize", timeout=30, json={"model": "gemma3-270m", "messages": _messages()}
    )
    assert [int(c) for c in chips] == gemma.json()["tokens"]
    page.wait_for_timeout(1200)  # a live snapshot of the model's own engine
    page.screenshot(path=str(SHOTS / "gemma3.png"), full_page=True)
    page.close()


def test_deterministic_server(make_server, browser):
    """`fornax serve --deterministic`: a request's logprobs are the same alone and among eight
    concurrent others (the default server's differ, tests/model/test_deterministic.py), and the
    page says which numerics the model runs with."""
    server = make_server(["--deterministic", "--no-access-log"])
    body = {"messages": _messages(), "temperature": 0, "max_tokens": 12, "logprobs": True}

    def logprobs(response: httpx.Response) -> list[float]:
        return [t["logprob"] for t in response.json()["choices"][0]["logprobs"]["content"]]

    alone = logprobs(httpx.post(server.url + "/v1/chat/completions", timeout=120, json=body))

    others = [
        {"messages": [{"role": "user", "content": f"Count to {n} in words."}], "max_tokens": 20 + n}
        for n in range(8)
    ]
    bodies = [*others[:3], body, *others[3:]]
    # threads, not asyncio: the browser fixture's event loop runs in this thread
    with ThreadPoolExecutor(len(bodies)) as pool:
        responses = list(
            pool.map(lambda b: httpx.post(server.url + "/v1/chat/completions", timeout=120, json=b), bodies)
        )
    assert logprobs(responses[3]) == alone
    models = httpx.get(server.url + "/v1/models", timeout=30).json()["data"]
    assert models[0]["deterministic"] is True
    page = browser.new_page()
    page.goto(server.url + "/ui/")
    page.wait_for_function("document.getElementById('numerics').textContent !== '–'")
    assert page.inner_text("#numerics").startswith("deterministic")
    page.close()
