"""Headless Chromium over the DevTools protocol: open a page, evaluate JavaScript, take a screenshot.

Needs only Debian's `chromium` and `websockets` (which uvicorn[standard] brings): no driver and
nothing downloaded. The UI test reads the live page with it, and `make bench` keeps a page open
with it while it measures.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from websockets.sync.client import ClientConnection, connect

__all__ = ["Browser", "BrowserError", "chromium_binary"]


class BrowserError(RuntimeError):
    """Chromium did not start, or the page raised."""


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class Browser:
    """One headless Chromium with one page. Use as a context manager."""

    def __init__(self, width: int = 1280, height: int = 900, binary: str | None = None) -> None:
        self.binary = binary or chromium_binary()
        if self.binary is None:
            raise BrowserError("chromium is not installed (Debian: apt-get install chromium)")
        self.width, self.height = width, height
        self._profile = Path(tempfile.mkdtemp(prefix="router-chromium-"))
        self._ids = itertools.count(1)
        self._process: subprocess.Popen[bytes] | None = None
        self._ws: ClientConnection | None = None
        self._connection = ExitStack()

    def __enter__(self) -> Self:
        flags = ["--headless=new", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                 "--no-default-browser-check", "--disable-extensions", "--remote-debugging-port=0",
                 f"--user-data-dir={self._profile}", f"--window-size={self.width},{self.height}"]
        if os.geteuid() == 0:
            flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
        self._process = subprocess.Popen([str(self.binary), *flags, "about:blank"], stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            self._ws = self._connection.enter_context(connect(self._page_socket(), max_size=None, open_timeout=10))
            self.send("Page.enable")
            self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=self.height,
                      deviceScaleFactor=1, mobile=False)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def pid(self) -> int | None:
        """Chromium's main process (its helpers are its children)."""
        return None if self._process is None else self._process.pid

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _page_socket(self, timeout_s: float = 20.0) -> str:
        """The first page target's websocket, once Chromium has written its DevTools port."""
        port_file = self._profile / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise BrowserError(f"chromium exited with {self._process.returncode}")
            if port_file.exists() and (lines := port_file.read_text().split()):
                with urllib.request.urlopen(f"http://127.0.0.1:{lines[0]}/json/list", timeout=5) as response:
                    pages = [t for t in json.load(response) if t.get("type") == "page"]
                if pages:
                    return str(pages[0]["webSocketDebuggerUrl"])
            time.sleep(0.05)
        raise BrowserError(f"chromium did not open its DevTools port within {timeout_s} s")

    def send(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command and its result (events in between are dropped)."""
        assert self._ws is not None
        command_id = next(self._ids)
        self._ws.send(json.dumps({"id": command_id, "method": method, "params": params}))
        while True:
            message = json.loads(self._ws.recv(timeout=30))
            if message.get("id") == command_id:
                if "error" in message:
                    raise BrowserError(f"{method}: {message['error']}")
                return dict(message.get("result", {}))

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", timeout_s=20)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise BrowserError(f"{expression!r} raised: {details.get('exception', {}).get('description', details)}")
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout_s: float = 15.0) -> Any:
        """Poll until the expression is truthy; its value."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise BrowserError(f"still false after {timeout_s} s: {expression}")
            time.sleep(0.1)

    def screenshot(self, path: Path, full_page: bool = True) -> None:
        if full_page:
            height = int(self.evaluate("document.documentElement.scrollHeight"))
            self.send("Emulation.setDeviceMetricsOverride", width=self.width, height=max(self.height, height),
                      deviceScaleFactor=1, mobile=False)
            time.sleep(0.3)  # one frame at the new size
        shot = self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        self._connection.close()
        self._ws = None
        if self._process is not None:
            _stop_group(self._process)
            self._process = None
        shutil.rmtree(self._profile, ignore_errors=True)


def _stop_group(process: subprocess.Popen[bytes]) -> None:
    """Chromium and its helpers (zygote, renderer) are one process group, started for this browser."""
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(wait_s)
            break
        except subprocess.TimeoutExpired:
            continue
