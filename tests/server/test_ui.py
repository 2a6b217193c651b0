"""The chat page (/) and the dashboard (/dashboard) in a real browser, against a real `kiln serve`.

The browser is Debian's `chromium` (`apt-get install chromium`) driven by Playwright through
`executable_path`: no browser is downloaded (`playwright install` is never needed). Without
chromium or the playwright package these tests skip, saying which is missing.

All in the default run (`make test` installs chromium through `make system-deps` where it can):
the key asked once, a streamed answer that grows then ends, the conversation kept over a reload,
stopping a long answer (the server frees the request), the model picker, the dashboard's plots
moving under load with the config's sources, and the page's own pure functions (markdown,
percentiles). With KILN_UI_SCREENSHOTS=DIR the picker and dashboard tests also write
ui-chat.png and ui-dashboard.png there (the README's screenshots:
`KILN_UI_SCREENSHOTS=docs pytest tests/server/test_ui.py`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_server import API_KEY, NAMES, Server, _serve, _wait_idle

pytestmark = pytest.mark.slow

# Debian's wrapper (/usr/bin/chromium) and the binary it runs.
CHROMIUM = ("chromium", "chromium-browser", "/usr/lib/chromium/chromium")
TIMEOUT_MS = 180_000  # a loaded 2-core machine (2 tokens/s at times) still finishes


def _chromium() -> str | None:
    for name in CHROMIUM:
        path = shutil.which(name) or (name if os.path.isfile(name) else None)
        if path:
            return path
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    exe = _chromium()
    if exe is None:
        pytest.skip("no chromium on this machine: `apt-get install chromium` (the UI tests drive "
                    "the system's browser, none is downloaded)")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e .[test])")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=exe, args=["--disable-gpu"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, gguf_path: Path,
           browser: Any) -> Iterator[Server]:
    # `browser` first: without chromium the module skips before starting a server.
    yield from _serve(tmp_path_factory.mktemp("ui"), gguf_path)


def _page(browser: Any, server: Server, *, with_key: bool = True) -> Any:
    """A fresh browser profile (empty localStorage); `with_key`: the API key already saved,
    as after the first visit."""
    ctx = browser.new_context(base_url=server.base_url, viewport={"width": 1280, "height": 860})
    ctx.set_default_timeout(TIMEOUT_MS)
    if with_key:
        ctx.add_init_script(f"localStorage.setItem('kiln.apiKey', {json.dumps(API_KEY)})")
    page = ctx.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.js_errors = errors  # type: ignore[attr-defined]
    return page


# Predicates are functions, never expressions: Playwright evaluates an expression with eval()
# at every poll, which the pages' Content-Security-Policy (rightly) refuses.
def _wait_for_models(page: Any) -> None:
    page.wait_for_function("() => document.querySelectorAll('#model option').length > 0")


def _set_settings(page: Any, **fields: Any) -> None:
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    for name, value in fields.items():
        page.fill(f"#{name}", str(value))


# Records the streaming answer's text length at every change (before it ends), so a test can
# tell an answer that grew from one that appeared whole.
_WATCH = """() => {
  window.__lengths = [];
  new MutationObserver(() => {
    const m = document.querySelector('#messages .msg.assistant:last-child');
    if (m && m.dataset.state === 'streaming')
      window.__lengths.push(m.querySelector('.content').textContent.length);
  }).observe(document.getElementById('messages'),
             {subtree: true, childList: true, characterData: true, attributes: true});
}"""


def _last_answer(page: Any) -> Any:
    return page.locator("#messages .msg.assistant").last


def _running(server: Server) -> float:
    for line in httpx.get(f"{server.base_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("kiln:num_requests_running{"):
            return float(line.split()[-1])
    raise AssertionError("no kiln:num_requests_running in /metrics")


def test_chat_asks_the_key_once_streams_an_answer_and_keeps_the_conversation(
    browser: Any, server: Server
) -> None:
    page = _page(browser, server, with_key=False)
    page.goto("/")
    # The server has --api-key: listing the models is refused, the page asks for the key once.
    page.wait_for_selector("#key-dialog[open]")
    page.fill("#key-dialog input", API_KEY)
    page.click("#key-dialog button[type=submit]")
    _wait_for_models(page)
    assert page.evaluate("localStorage.getItem('kiln.apiKey')") == API_KEY
    assert page.input_value("#system") == "You are a helpful assistant."

    _set_settings(page, temperature=0, max_tokens=16)
    page.evaluate(_WATCH)
    page.fill("#prompt", "Write a short poem about the sea.")
    page.keyboard.press("Enter")
    answer = _last_answer(page)
    page.wait_for_selector("#messages .msg.assistant[data-state=done]")
    text = answer.locator(".content").inner_text()
    lengths = [n for n in page.evaluate("window.__lengths") if n > 0]
    assert text.strip(), "the answer is empty"
    assert len(set(lengths)) >= 2, f"the answer did not grow while streaming: {lengths}"
    stats = answer.locator(".stats").inner_text()
    # counted by the stream's usage (a count of chunks would read "≈N tokens")
    assert re.match(r"\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s", stats), stats
    assert not page.js_errors  # type: ignore[attr-defined]

    page.reload()
    page.wait_for_selector("#messages .msg.assistant[data-state=done]")
    assert _last_answer(page).locator(".content").inner_text() == text
    assert page.locator("#conversations li").count() == 1
    assert "poem about the sea" in page.locator("#conversations li .title").inner_text()
    assert page.evaluate("localStorage.getItem('kiln.apiKey')") == API_KEY  # asked only once
    page.context.close()


def test_markdown_is_escaped_first_and_renders_code_lists_and_links(
    browser: Any, server: Server
) -> None:
    page = _page(browser, server)
    page.goto("/")
    html = page.evaluate("""() => Markdown.render([
        '# Title', 'Some **bold**, *italic* and `a < b` code.',
        '- one', '- two', '  - nested', '1. first', '2. second',
        '<script>alert(1)</script> <img src=x onerror=alert(1)>',
        '[ok](https://example.org/a?b=1&c=2) [bad](javascript:alert(1))',
        '```python', 'print("<hi>")', '```', 'after'].join('\\n'))""")
    assert "<h1>Title</h1>" in html
    assert "<strong>bold</strong>" in html and "<em>italic</em>" in html
    assert "<code>a &lt; b</code>" in html
    assert "<ul><li>one</li><li>two<ul><li>nested</li></ul></li></ul>" in html
    assert "<ol><li>first</li><li>second</li></ol>" in html
    assert "<script>" not in html and "<img" not in html and "&lt;script&gt;" in html
    assert 'href="https://example.org/a?b=1&amp;c=2"' in html
    assert "javascript:" not in html.split("bad")[0][-200:] and 'href="javascript' not in html
    assert '<span class="code-lang">python</span>' in html and "print(&quot;&lt;hi&gt;&quot;)" in html
    assert html.count('class="copy-code"') == 1 and html.endswith("<p>after</p>")
    # An answer still streaming: an open fence is code up to the end.
    assert "<pre><code>x = 1</code></pre>" in page.evaluate(
        "Markdown.render('```\\nx = 1')")
    page.context.close()


# A stream as the server sends it for a model with a reasoning parser (--reasoning-parser qwen3):
# none of the test models thinks, so this one is replayed to the page from a recording.
_REASONING_STREAM = "".join(f"data: {json.dumps(ev)}\n\n" for ev in [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "The user wants "}}]},
    {"choices": [{"index": 0, "delta": {"reasoning_content": "code."}}]},
    {"choices": [{"index": 0, "delta": {"content": "Here:\n```python\nprint(1)\n```"}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}},
]) + "data: [DONE]\n\n"


def test_reasoning_shows_apart_and_copy_buttons_copy(browser: Any, server: Server) -> None:
    page = _page(browser, server)
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"Content-Type": "text/event-stream"}, body=_REASONING_STREAM))
    page.goto("/")
    page.fill("#prompt", "Print one in Python.")
    page.click("#send")
    page.wait_for_selector("#messages .msg.assistant[data-state=done]")
    answer = _last_answer(page)
    reasoning = answer.locator("details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # folded
    reasoning.locator("summary").click()
    assert reasoning.locator(".reasoning-body").inner_text() == "The user wants code."
    assert "The user wants" not in answer.locator(".content").inner_text()
    assert answer.locator(".stats").inner_text().startswith("7 tokens")
    answer.locator(".copy-code").click()
    answer.locator(".copy-code", has_text="Copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == "print(1)"
    answer.locator(".copy-msg").click()
    answer.locator(".copy-msg", has_text="Copied").wait_for()
    assert page.evaluate("navigator.clipboard.readText()") == "Here:\n```python\nprint(1)\n```"
    page.context.close()


def test_dashboard_percentiles_interpolate_inside_the_bucket(browser: Any, server: Server) -> None:
    page = _page(browser, server)
    page.goto("/dashboard")
    page.wait_for_function("() => typeof KilnDash === 'object'")
    q = "([q, b, c]) => KilnDash.quantile(q, b, c)"
    bounds = [0.1, 0.2, 0.4]
    # 10 observations in (0.1, 0.2], 10 in (0.2, 0.4]: the median is the first bucket's top.
    assert page.evaluate(q, [0.5, bounds, [0, 10, 20, 20]]) == pytest.approx(0.2)
    assert page.evaluate(q, [0.75, bounds, [0, 10, 20, 20]]) == pytest.approx(0.3)
    assert page.evaluate(q, [0.99, bounds, [0, 0, 0, 5]]) == pytest.approx(0.4)  # +Inf bucket
    assert page.evaluate(q, [0.5, bounds, [0, 0, 0, 0]]) is None
    page.context.close()


def test_stop_ends_the_answer_and_the_server_frees_the_request(
    browser: Any, server: Server
) -> None:
    page = _page(browser, server)
    page.goto("/")
    _wait_for_models(page)
    _set_settings(page, temperature=0.8, max_tokens=900)
    page.fill("#prompt", "Tell me a very long story about a lighthouse keeper, in many chapters.")
    page.click("#send")
    answer = _last_answer(page)
    page.wait_for_function(
        "() => document.querySelector('#messages .msg.assistant:last-child .content')"
        ".textContent.length > 40")
    assert answer.get_attribute("data-state") == "streaming"
    page.click("#stop")
    page.wait_for_selector("#messages .msg.assistant[data-state=stopped]")
    assert page.locator("#send").is_visible() and page.locator("#stop").is_hidden()
    stopped = answer.locator(".content").inner_text()
    time.sleep(1.5)
    assert answer.locator(".content").inner_text() == stopped  # no longer growing
    assert "stopped" in answer.locator(".stats").inner_text()
    _wait_idle(server)  # the server saw the disconnect and freed the request
    assert _running(server) == 0
    page.context.close()


def test_model_picker_lists_the_served_names_and_the_request_carries_the_choice(
    browser: Any, server: Server, tmp_path: Path
) -> None:
    page = _page(browser, server)
    page.goto("/")
    _wait_for_models(page)
    assert page.eval_on_selector_all("#model option", "os => os.map(o => o.value)") == NAMES
    page.select_option("#model", NAMES[1])
    _set_settings(page, temperature=0, max_tokens=24)
    page.fill("#prompt", "Show a Python function that adds two numbers, in a code block.")
    with page.expect_request("**/v1/chat/completions") as req:
        page.click("#send")
    body = req.value.post_data_json
    assert body["model"] == NAMES[1] and body["stream"] is True
    assert body["messages"][0] == {"role": "system", "content": "You are a helpful assistant."}
    assert body["temperature"] == 0 and body["max_tokens"] == 24
    page.wait_for_selector("#messages .msg.assistant[data-state=done]")
    assert NAMES[1] in _last_answer(page).locator(".who").inner_text()
    page.reload()  # the choice is kept with the other settings
    _wait_for_models(page)
    assert page.input_value("#model") == NAMES[1]
    _screenshot(page, "ui-chat.png", tmp_path)
    page.context.close()


def test_dashboard_plots_move_under_load_and_shows_the_config_sources(
    browser: Any, server: Server, tmp_path: Path
) -> None:
    page = _page(browser, server)
    page.goto("/dashboard")
    page.wait_for_selector("#config-table tbody tr[data-setting=dtype]")
    dtype = page.locator("#config-table tr[data-setting=dtype]")
    assert dtype.locator(".value").inner_text() == "float32"
    assert dtype.locator(".source").inner_text() == "cli"
    assert "--dtype" in dtype.locator(".reason").inner_text()
    assert page.locator("#config-table tr[data-setting=api_key] .value").inner_text() == "***"
    sources = set(page.eval_on_selector_all("#config-table td.source", "ts => ts.map(t => "
                                                                       "t.textContent)"))
    assert {"cli", "default"} <= sources
    assert page.locator("#dash-model").input_value() == NAMES[0]
    assert ", ".join(NAMES) in page.locator("#served").inner_text()

    def load() -> None:
        httpx.post(f"{server.base_url}/v1/completions", timeout=600,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": NAMES[0], "prompt": "Count to 20:", "max_tokens": 24,
                         "ignore_eos": True})

    workers = [threading.Thread(target=load) for _ in range(3)]
    for w in workers:
        w.start()
    try:
        page.wait_for_function("() => KilnDash.points.throughput[0].some(p => p[1] > 0)")
        page.wait_for_function("() => KilnDash.points.requests[0].some(p => p[1] > 0)")
    finally:
        for w in workers:
            w.join()
    # Finished requests land in the TTFT histogram: a percentile within the window.
    page.wait_for_function("() => KilnDash.points.ttft[0].some(p => p[1] !== null && p[1] > 0)")
    assert re.match(r"generated [\d.]+ tok/s",
                    page.locator("[data-plot=throughput] .now").inner_text())
    _screenshot(page, "ui-dashboard.png", tmp_path)
    assert not page.js_errors  # type: ignore[attr-defined]
    page.context.close()


def _screenshot(page: Any, name: str, tmp: Path) -> None:
    """Into tmp (checked), and into $KILN_UI_SCREENSHOTS when set (the README's images)."""
    path = tmp / name
    page.screenshot(path=str(path), full_page=False)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("KILN_UI_SCREENSHOTS")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, Path(target) / name)
