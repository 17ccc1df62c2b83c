"""The report in a real browser: headless Chromium driven over the DevTools protocol.

Chromium is started with a temporary profile and every route off the machine closed (a dead
proxy, a host resolver that resolves nothing, no background services). The test talks to it
through a minimal WebSocket client (stdlib only; CDP needs text frames and nothing else),
loads report.html from disk, checks the DOM, clicks a step with real mouse events and saves
a screenshot (to tmp_path, and to $RELIGN_ARTIFACTS when that is set).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from relign.report import PALETTE, write_compare, write_report

from ..report.test_report import make_rl_run
from ..report.test_compare import two_runs

BROWSERS = ("chromium", "chromium-browser", "google-chrome")


def _browser() -> str | None:
    return next((p for p in map(shutil.which, BROWSERS) if p), None)


class WebSocket:
    """Just enough RFC 6455 for the DevTools protocol: masked text frames out, any frames in."""

    def __init__(self, url: str, timeout: float = 30.0):
        u = urlsplit(url)
        self.sock = socket.create_connection((u.hostname, u.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {u.path} HTTP/1.1\r\nHost: {u.hostname}:{u.port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
        self.buf = bytearray()
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, _, rest = bytes(self.buf).partition(b"\r\n\r\n")
        if b" 101 " not in head.split(b"\r\n", 1)[0]:
            raise ConnectionError(f"websocket handshake refused: {head[:200]!r}")
        self.buf = bytearray(rest)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ConnectionError("browser closed the connection")
        self.buf += chunk

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out

    def send(self, text: str) -> None:
        payload, mask = text.encode(), os.urandom(4)
        n = len(payload)
        header = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                  bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                  bytes([0x80 | 127]) + struct.pack(">Q", n))
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))  # clients must mask (RFC 6455 5.3)
        self.sock.sendall(header + mask + masked)

    def recv(self) -> str:
        message = b""
        while True:
            b0, b1 = self._take(2)
            n = b1 & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._take(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._take(8))[0]
            data = self._take(n)  # server frames are never masked
            opcode = b0 & 0x0F
            if opcode == 0x8:
                raise ConnectionError("browser closed the websocket")
            if opcode in (0x0, 0x1, 0x2):  # continuation, text, binary
                message += data
                if b0 & 0x80:  # FIN
                    return message.decode()

    def close(self) -> None:
        self.sock.close()


class DevTools:
    """Commands and events of one page target."""

    def __init__(self, ws: WebSocket):
        self.ws, self.last_id, self.events = ws, 0, []

    def call(self, method: str, **params):
        self.last_id += 1
        self.ws.send(json.dumps({"id": self.last_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == self.last_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg["result"]
            self.events.append(msg)

    def wait_event(self, method: str, timeout: float = 30.0) -> dict:
        deadline = time.time() + timeout
        while time.time() < deadline:
            for e in self.events:
                if e.get("method") == method:
                    return e
            self.events.append(json.loads(self.ws.recv()))
        raise TimeoutError(method)

    def js(self, expression: str):
        r = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expression}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def set_value(self, selector: str, value: str, event: str) -> None:
        """Set a form control as typing or choosing would, and fire the event the page listens to."""
        self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.value = {json.dumps(value)};"
                f" e.dispatchEvent(new Event({json.dumps(event)})); }})()")

    def _centre(self, selector: str) -> list[float]:
        return self.js(f"(() => {{ const e = document.querySelector({json.dumps(selector)}); e.scrollIntoView({{block: 'center'}});"
                       " const r = e.getBoundingClientRect(); return [r.x + r.width / 2, r.y + r.height / 2]; })()")

    def hover(self, selector: str) -> None:
        x, y = self._centre(selector)
        self.call("Input.dispatchMouseEvent", type="mouseMoved", x=x, y=y)

    def click(self, selector: str) -> None:
        """A real click: mouse pressed and released at the element's centre, as a user would."""
        x, y = self._centre(selector)
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, button="left", clickCount=1)


@pytest.fixture
def browser(tmp_path):
    exe = _browser()
    if exe is None:
        pytest.skip(f"no Chromium found ({', '.join(BROWSERS)}); install Debian's `chromium` to run the browser test")
    profile, log = tmp_path / "profile", open(tmp_path / "chromium.log", "w")
    proc = subprocess.Popen([
        exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
        "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1280,1400",
        # off the network: a dead proxy for everything but loopback, and no name resolves
        "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>", "--host-resolver-rules=MAP * ~NOTFOUND",
        "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-extensions",
        "--no-first-run", "--no-default-browser-check", "--mute-audio", "--hide-scrollbars",
        "about:blank",
    ], stdout=log, stderr=log)
    port_file = profile / "DevToolsActivePort"  # Chromium writes its port here once it listens
    deadline = time.time() + 60
    while not (port_file.is_file() and port_file.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    ws = None
    try:
        if not port_file.is_file():
            pytest.fail(f"{exe} did not start (exit code {proc.poll()}):\n{(tmp_path / 'chromium.log').read_text()[-2000:]}")
        port = int(port_file.read_text().split()[0])
        no_proxy = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        targets = json.loads(no_proxy.open(f"http://127.0.0.1:{port}/json/list", timeout=30).read())
        page = next(t for t in targets if t["type"] == "page")
        ws = WebSocket(page["webSocketDebuggerUrl"])
        yield DevTools(ws)
    finally:
        if ws is not None:
            ws.close()
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _save_screenshot(cdp: DevTools, path: Path) -> Path:
    shot = cdp.call("Page.captureScreenshot", format="png")
    path.write_bytes(base64.b64decode(shot["data"]))
    artifacts = os.environ.get("RELIGN_ARTIFACTS")
    if artifacts:
        Path(artifacts).mkdir(parents=True, exist_ok=True)
        path = Path(shutil.copy(path, Path(artifacts) / path.name))
    print(f"screenshot: {path}")
    return path


def _open_offline(cdp, run) -> str:
    """Load the run's report; assert nothing but the file itself was requested and its script
    ran without an error. Returns the page's URL."""
    return _open_page(cdp, write_report(run))


def _open_page(cdp, path: Path) -> str:
    """``_open_offline`` for a page already written (a comparison of runs)."""
    url = path.resolve().as_uri()
    for domain in ("Page", "Runtime", "Network"):
        cdp.call(f"{domain}.enable")
    cdp.call("Page.navigate", url=url)
    cdp.wait_event("Page.loadEventFired")
    requested = [e["params"]["request"]["url"] for e in cdp.events if e.get("method") == "Network.requestWillBeSent"]
    assert requested == [url], requested
    errors = [e for e in cdp.events if e.get("method") == "Runtime.exceptionThrown"
              or (e.get("method") == "Runtime.consoleAPICalled" and e["params"]["type"] == "error")]
    assert not errors, errors
    return url


def test_report_in_headless_chromium(browser, tmp_path):
    cdp = browser
    _open_offline(cdp, make_rl_run(tmp_path / "rl"))

    metrics = cdp.js("[...document.querySelectorAll('figure.chart')].map(f => f.dataset.metric)")
    assert {"reward/mean", "eval/accuracy", "actor/kl", "actor/entropy", "response/length_mean", "actor/clip_frac",
            "actor/grad_norm", "perf/tokens_per_s", "time/rollout_s"} <= set(metrics)
    assert cdp.js("document.querySelectorAll('figure.chart svg path.line').length") >= len(metrics) - 1
    assert cdp.js("[...document.querySelectorAll('.step-btn')].map(b => b.dataset.step)") == ["1", "2"]
    cdp.hover("#chart-reward svg")  # the middle of the reward plot is step 2 (steps 1..3)
    assert cdp.js("document.querySelector('#chart-reward .readout').textContent") == "step 2: reward/mean 0.2"

    # the newest step is shown first; its hostile response is text, not markup
    assert cdp.js("document.getElementById('trace-view').dataset.step") == "2"
    assert cdp.js("document.querySelectorAll('#trace-view .trace-row').length") == 3
    assert cdp.js("document.querySelectorAll('#trace-view img, #trace-view script').length") == 0
    assert "</script><script>" in cdp.js("document.getElementById('trace-view').textContent")

    # a real click on step 1 shows step 1's traces
    cdp.click('.step-btn[data-step="1"]')
    assert cdp.js("document.getElementById('trace-view').dataset.step") == "1"
    assert cdp.js("document.querySelector('.step-btn.active').dataset.step") == "1"
    rows = cdp.js("[...document.querySelectorAll('#trace-view .trace-row')].map(r => [r.dataset.correct, r.dataset.truncated])")
    assert rows == [["1", "0"], ["0", "1"]]
    assert "Alpha prompt" in cdp.js("document.getElementById('trace-view').textContent")
    assert cdp.js("document.querySelectorAll('#trace-view .tok').length") == 4  # token spans, shaded
    assert cdp.js("document.querySelector('#trace-view .tok').style.background") != ""

    # filters: the select and the search box hide rows
    visible = "[...document.querySelectorAll('#trace-view .trace-row')].filter(r => !r.hidden).length"
    cdp.set_value("#trace-filter", "truncated", "change")
    assert cdp.js(visible) == 1
    cdp.set_value("#trace-filter", "all", "change")
    cdp.set_value("#trace-search", "IDEA", "input")
    assert cdp.js(visible) == 1
    cdp.set_value("#trace-search", "", "input")
    assert cdp.js(visible) == 2
    cdp.set_value("#trace-shade", "logp", "change")  # re-shaded by log-prob (logp -0.1: a faint orange)
    assert cdp.js("document.querySelector('#trace-view .tok').style.background").startswith("rgba(234, 88, 12, 0.06")
    assert cdp.js("document.querySelectorAll('#trace-view .tok')[1].style.background") == ""  # logp unknown (-inf)

    cdp.set_value("#trace-shade", "advantage", "change")
    cdp.js("document.getElementById('traces').scrollIntoView()")
    shot = _save_screenshot(cdp, tmp_path / "report_traces.png")
    assert shot.stat().st_size > 10_000
    assert not [e for e in cdp.events if e.get("method") == "Runtime.exceptionThrown"]


def test_search_report_in_headless_chromium(browser, tmp_path):
    from ..report.test_search import make_single_search_run, make_sweep_run

    run = make_sweep_run(tmp_path / "sweep")
    make_single_search_run(run)  # eval.json + search.jsonl as well: the first cell is search.jsonl, with trees
    cdp = browser
    _open_offline(cdp, run)

    # the chart: a series per strategy, error bars, a readout on hover
    assert cdp.js("[...document.querySelectorAll('#chart-sweep g.series')].map(g => g.dataset.series)") == ["cot", "best_of_n", "mcts"]
    assert cdp.js("document.querySelectorAll('#chart-sweep path.errbar').length") == 9
    cdp.hover("#chart-sweep g.series[data-series='mcts'] circle.pt")
    assert cdp.js("document.querySelector('#chart-sweep .readout').textContent").startswith("mcts, budget 128: accuracy 0.4")

    # the tree of problem 0 (open by default): the chosen path open, hostile step text inert
    visible = "(sel => { const e = document.querySelector(sel); return !!e && e.checkVisibility(); })"
    node = "#search .search-cell[data-cell='0'] li[data-node='{}']"
    assert cdp.js("document.querySelectorAll(\"#search .search-cell[data-cell='0'] .tree[data-problem='0'] li.node\").length") == 6
    assert cdp.js(f"{visible}({json.dumps(node.format(5))})")  # the chosen leaf, three levels down
    assert cdp.js("document.querySelectorAll('#search img, #search script').length") == 0
    assert "</script><script>alert(1)" in cdp.js("document.getElementById('search').textContent")

    # a real click on node 1's summary folds it: its children disappear; a second click unfolds it
    summary = node.format(1) + " > details > summary"
    cdp.click(summary)
    assert cdp.js(f"document.querySelector({json.dumps(node.format(1) + ' > details')}).open") is False
    assert not cdp.js(f"{visible}({json.dumps(node.format(3))})")
    cdp.click(summary)
    assert cdp.js(f"{visible}({json.dumps(node.format(3))})")
    # a folded sibling branch (node 2 is a leaf under the open root) stays visible; "collapse all" folds everything
    cdp.click("#search .search-cell[data-cell='0'] .tree[data-problem='0'] button[data-act='collapse']")
    assert not cdp.js(f"{visible}({json.dumps(node.format(1))})")
    cdp.click("#search .search-cell[data-cell='0'] .tree[data-problem='0'] button[data-act='chosen']")
    assert cdp.js(f"{visible}({json.dumps(node.format(5))})")

    # the file selector shows another cell; the filter hides problems
    cdp.set_value("#search-file", "3", "change")
    assert cdp.js("[...document.querySelectorAll('.search-cell')].filter(c => !c.hidden).map(c => c.dataset.file)") == ["search/best_of_n_128.jsonl"]
    cdp.set_value("#search-filter", "incorrect", "change")
    assert cdp.js("document.getElementById('search-count').textContent") == "1 of 3 problems shown"
    cdp.set_value("#search-filter", "all", "change")
    cdp.set_value("#search-file", "0", "change")

    cdp.js("document.getElementById('search').scrollIntoView()")
    shot = _save_screenshot(cdp, tmp_path / "report_search.png")
    assert shot.stat().st_size > 10_000
    assert not [e for e in cdp.events if e.get("method") == "Runtime.exceptionThrown"]


def test_comparison_in_headless_chromium(browser, tmp_path):
    a, b = two_runs(tmp_path)  # a/exp and b/exp: tokens/s 100, 110, 120 against a flat 200
    cdp = browser
    _open_page(cdp, write_compare([a, b], tmp_path / "compare.html"))

    assert cdp.js("[...document.querySelectorAll('#run-legend li')].map(li => li.dataset.run)") == ["a/exp", "b/exp"]
    assert str(a) in cdp.js("document.getElementById('run-legend').textContent")
    # the loss chart overlays both runs: a's train/loss and eval/loss in a's colour, b's train/loss in b's
    strokes = cdp.js("[...document.querySelectorAll('#chart-loss path.line')].map(p => p.getAttribute('stroke'))")
    assert strokes == [PALETTE[0], PALETTE[0], PALETTE[1]]
    assert cdp.js("document.querySelector('#chart-loss svg').getBoundingClientRect().width") > 200  # drawn, not collapsed
    # hovering the middle of the throughput chart (steps 1..3) reads both runs at step 2
    cdp.hover("#chart-tokens-per-s svg")
    assert cdp.js("document.querySelector('#chart-tokens-per-s .readout').textContent") == "step 2: a/exp 110 · b/exp 200"
    assert cdp.js("document.querySelector('#constant-metrics').textContent").count("train/lr") == 1
    assert cdp.js("[...document.querySelectorAll('#compare-summary tr[data-row=\"wall time\"] td')].map(td => td.textContent)") \
        == ["20.0s", "30.0s"]

    cdp.js("document.getElementById('metrics').scrollIntoView()")
    shot = _save_screenshot(cdp, tmp_path / "report_compare.png")
    assert shot.stat().st_size > 10_000
    assert not [e for e in cdp.events if e.get("method") == "Runtime.exceptionThrown"]


_TEXT_BOXES = """(sel => { const svg = document.querySelector(sel); svg.scrollIntoView({block: 'start'});
  const b = r => [r.left, r.top, r.right, r.bottom];
  return {svg: b(svg.getBoundingClientRect()), frame: b(svg.querySelector('rect.rd-frame').getBoundingClientRect()),
          texts: [...svg.querySelectorAll('text')].map(t => [t.textContent, ...b(t.getBoundingClientRect())])}; })"""


def _assert_text_apart(boxes: dict) -> None:
    """No two texts of the diagram overlap, each lies inside the drawing, none inside the plot's frame."""
    texts, (sl, st, sr, sb), (fl, ft, fr, fb) = boxes["texts"], boxes["svg"], boxes["frame"]
    assert len(texts) > 20
    for text, left, top, right, bottom in texts:
        assert right - left > 1 and sl <= left and right <= sr and st <= top and bottom <= sb, (text, left, top, right, bottom)
        assert right <= fl or left >= fr or bottom <= ft or top >= fb, f"{text!r} inside the plot"
    for i, (a, al, at, ar, ab) in enumerate(texts):
        for b, bl, bt, br, bb in texts[i + 1:]:
            assert ar <= bl or br <= al or ab <= bt or bb <= at, f"{a!r} {[al, at, ar, ab]} overlaps {b!r} {[bl, bt, br, bb]}"


def test_reliability_diagram_in_headless_chromium(browser, tmp_path):
    from ..report.test_reliability import calibration_rows, make_calibration_eval_run

    rows = calibration_rows()  # every bin filled, most with 3-digit counts, and 37 without an answer
    cdp = browser
    _open_offline(cdp, make_calibration_eval_run(tmp_path / "eval", rows))
    # the page opens with the diagram, above the summary's table, in the first screen
    assert cdp.js("document.querySelector('main').firstElementChild.id") == "reliability"
    assert cdp.js("document.querySelector('#reliability svg').getBoundingClientRect().top") < cdp.js("window.innerHeight")
    assert cdp.js("document.querySelectorAll('#reliability rect.rd-bar').length") == 10
    assert cdp.js("document.querySelector('#reliability rect.rd-abstain').dataset.count") == "37"
    _assert_text_apart(cdp.js(f"{_TEXT_BOXES}('#reliability svg')"))
    _save_screenshot(cdp, tmp_path / "report_reliability.png")

    # the file relign eval writes beside the report, opened on its own
    from relign.report.reliability import reliability_svg

    g = [r["reader"] for r in rows]
    svg = tmp_path / "reliability.svg"
    svg.write_text(reliability_svg([x["confidence"] for x in g], [x["correct"] for x in g], [x["no_answer"] for x in g],
                                   standalone=True))
    cdp.events.clear()  # the report's requests and load event: _open_page checks the svg's alone
    _open_page(cdp, svg)
    _assert_text_apart(cdp.js(f"{_TEXT_BOXES}('svg')"))
