"""Open a local HTML page in headless Chromium with the network off and report what rendered.

Talks the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages separated by NUL on
file descriptors 3 and 4), so it needs no Python package and no browser download: only the
Debian package ``chromium`` (or ``$LENS_ATTRIB_CHROMIUM``). The network is off three ways: every
host name resolves to nothing, every request goes to a dead proxy, and DevTools' network
emulation is offline; every request the page makes is recorded, so a test can also assert that
none left ``file:``.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
LOCAL_SCHEMES = ("file:", "data:", "about:", "blob:")

FIGURE_STATE_JS = """(() => {
  const divs = [...document.querySelectorAll('.plotly-graph-div')];
  const drawn = divs.filter(d => d.querySelector('.main-svg') && d._fullData
                             && d._fullData.length > 0);
  return {
    figures: divs.length,
    rendered: drawn.length,
    sizes: drawn.map(d => [Math.round(d.getBoundingClientRect().width),
                           Math.round(d.getBoundingClientRect().height)]),
    traces: drawn.map(d => d._fullData.map(t => t.type).join('+')),
    plotly: (typeof Plotly === 'undefined') ? null : Plotly.version,
    width: document.documentElement.scrollWidth,
    height: document.documentElement.scrollHeight,
    ready: document.readyState,
  };
})()"""


def find_chromium() -> str | None:
    """``$LENS_ATTRIB_CHROMIUM`` or the first Chromium/Chrome on ``PATH``."""
    explicit = os.environ.get("LENS_ATTRIB_CHROMIUM")
    if explicit:
        return explicit
    for name in CANDIDATES:
        found = shutil.which(name)
        if found:
            return found
    return None


@dataclass
class PageReport:
    """What the browser saw: figure counts and sizes, console errors, requests, the DOM."""

    state: dict[str, Any]
    errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)
    dom: str = ""
    screenshot: Path | None = None

    @property
    def remote_requests(self) -> list[str]:
        return [url for url in self.requests if not url.startswith(LOCAL_SCHEMES)]


class DevToolsPipe:
    """A Chromium process and its DevTools pipe (one page session)."""

    def __init__(self, executable: str, profile: Path) -> None:
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        flags = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--disable-dev-shm-usage",
            "--hide-scrollbars",
            "--mute-audio",
            "--host-resolver-rules=MAP * ~NOTFOUND",
            "--proxy-server=http://127.0.0.1:9",
            "--proxy-bypass-list=<-loopback>",
            f"--user-data-dir={profile}",
            "--remote-debugging-pipe",
            "about:blank",
        ]
        # bash (dash takes only one-digit fds) puts our pipe ends on fds 3 (commands in) and 4
        # (replies out), then execs
        script = f'exec "$0" "$@" 3<&{to_browser_r} 4>&{from_browser_w}'
        self.process = subprocess.Popen(
            ["/bin/bash", "-c", script, executable, *flags],
            pass_fds=(to_browser_r, from_browser_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(
        self, method: str, params: dict[str, Any] | None = None, *, session: str | None = None
    ) -> dict[str, Any]:
        """Send one command and wait for its reply (events that arrive meanwhile are kept)."""
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        while True:
            reply = self._read(timeout=60.0)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))
            self.events.append(reply)

    def wait_event(self, method: str, timeout: float) -> dict[str, Any]:
        """The first event ``method`` (already received or arriving within ``timeout``)."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no {method} within {timeout} s")
            self.events.append(self._read(timeout=left))

    def drain(self, seconds: float) -> None:
        """Collect the events that arrive within ``seconds``."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            try:
                self.events.append(self._read(timeout=left))
            except TimeoutError:
                return

    def _read(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._from_browser], [], [], max(left, 0.0))
            if not ready:
                raise TimeoutError("Chromium did not answer on the DevTools pipe")
            chunk = os.read(self._from_browser, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited (code {self.process.poll()})")
            self._buffer += chunk
        message, _, self._buffer = self._buffer.partition(b"\0")
        return dict(json.loads(message))

    def close(self) -> None:
        try:
            self.send("Browser.close")
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        os.close(self._to_browser)
        os.close(self._from_browser)


def _errors(events: list[dict[str, Any]]) -> list[str]:
    """Console errors, uncaught exceptions and browser log errors of the page."""
    found = []
    for event in events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = params.get("args", [])
            found.append("console: " + " ".join(str(a.get("value", a)) for a in args))
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            found.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            found.append(f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}")
    return found


def open_page(
    executable: str,
    page: Path,
    *,
    screenshot: Path | None = None,
    expect_figures: int | None = None,
    timeout: float = 60.0,
    width: int = 1280,
    max_height: int = 16384,
) -> PageReport:
    """Load ``page`` offline, wait until ``expect_figures`` plotly figures have drawn (or the
    page's own count, or ``timeout``), then return the figure state, the errors, the requests
    made, the DOM, and a full-page PNG at ``screenshot``."""
    with tempfile.TemporaryDirectory(prefix="lens-attrib-chromium-") as profile:
        browser = DevToolsPipe(executable, Path(profile))
        try:
            target = browser.send("Target.createTarget", {"url": "about:blank"})["targetId"]
            session = browser.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
                "sessionId"
            ]
            for domain in ("Page", "Runtime", "Log", "Network"):
                browser.send(f"{domain}.enable", session=session)
            browser.send(
                "Network.emulateNetworkConditions",
                {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1},
                session=session,
            )
            browser.send(
                "Emulation.setDeviceMetricsOverride",
                {"width": width, "height": 900, "deviceScaleFactor": 1, "mobile": False},
                session=session,
            )
            browser.send("Page.navigate", {"url": page.resolve().as_uri()}, session=session)
            browser.wait_event("Page.loadEventFired", timeout)
            state = _state(browser, session)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                wanted = state["figures"] if expect_figures is None else expect_figures
                if state["ready"] == "complete" and state["rendered"] >= wanted:
                    break
                browser.drain(0.2)
                state = _state(browser, session)
            browser.drain(0.5)  # late console messages, resize redraws
            state = _state(browser, session)
            dom = _evaluate(browser, session, "document.documentElement.outerHTML")
            if screenshot is not None:
                height = min(int(state["height"]), max_height)
                shot = browser.send(
                    "Page.captureScreenshot",
                    {
                        "format": "png",
                        "captureBeyondViewport": True,
                        "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1},
                    },
                    session=session,
                )
                screenshot.write_bytes(base64.b64decode(shot["data"]))
            requests = [
                e["params"]["request"]["url"]
                for e in browser.events
                if e.get("method") == "Network.requestWillBeSent"
            ]
            return PageReport(state, _errors(browser.events), requests, str(dom), screenshot)
        finally:
            browser.close()


def _evaluate(browser: DevToolsPipe, session: str, expression: str) -> Any:
    reply = browser.send(
        "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
    )
    if "exceptionDetails" in reply:
        raise RuntimeError(f"page script failed: {reply['exceptionDetails']}")
    return reply["result"].get("value")


def _state(browser: DevToolsPipe, session: str) -> dict[str, Any]:
    return dict(_evaluate(browser, session, FIGURE_STATE_JS))
