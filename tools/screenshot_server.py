"""Screenshot of the web page of ``sdlite serve`` for the docs: docs/server_page.png.

Starts ``sdlite serve`` (the shipped demo model unless --model is given) on a free loopback port, opens the page
in Debian's chromium (headless, through Playwright), generates a few images so the history is not empty, and
saves a screenshot of the whole page at the window's width. Offline: nothing but the loopback server is reached.

    .venv/bin/python tools/screenshot_server.py [--model PATH] [--output docs/server_page.png]
"""
from __future__ import annotations

import argparse
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parent.parent
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
# (prompt, seed): earlier ones fill the history, the last one is the result shown
SHOTS = [("a yellow star on a purple background", 2), ("a white triangle on a green background", 5),
         ("a red circle on a blue background", 3)]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str | None, log) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sdlite", "serve", "--host", "127.0.0.1", "--port", str(port)]
    if model:
        cmd += ["--model", model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if not model:   # the demo model is tiny: one thread runs it faster than two
        env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"sdlite serve exited with status {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/sdapi/v1/samplers", timeout=2):
                return proc, url
        except OSError:
            if time.monotonic() > deadline:
                proc.terminate()
                raise SystemExit("sdlite serve did not answer within 180 s")
            time.sleep(0.3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="model for sdlite serve (default: the shipped demo model)")
    ap.add_argument("--output", default=str(ROOT / "docs" / "server_page.png"))
    ap.add_argument("--size", default="1200x800", help="window size, WxH")
    args = ap.parse_args()
    width, height = (int(v) for v in args.size.split("x"))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        raise SystemExit("chromium is not installed (make setup installs Debian's chromium)")

    from playwright.sync_api import sync_playwright

    with tempfile.TemporaryFile() as log:
        proc, url = start_server(args.model, log)
        try:
            with sync_playwright() as p:
                browser = p.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS)
                page = browser.new_page(viewport={"width": width, "height": height})
                page.set_default_timeout(120_000)
                page.goto(url + "/")
                page.wait_for_function("document.querySelectorAll('#sampler option').length > 0")
                for prompt, seed in SHOTS:
                    page.fill("#prompt", prompt)
                    page.fill("#seed", str(seed))
                    page.click("#generate")
                    page.wait_for_function("!document.getElementById('generate').disabled")
                    if page.locator("#error").is_visible():
                        raise SystemExit("the page shows an error: " + page.locator("#error").text_content())
                page.locator("#prompt").blur()
                page.evaluate("window.scrollTo(0, 0)")   # clicking Generate scrolled the form's end into view
                png = page.screenshot(full_page=True)   # the whole page: the form is taller than the window
                browser.close()
        except BaseException:
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            proc.terminate()
            proc.wait(timeout=30)

    # a UI screenshot has few colours: a 256-colour palette keeps it sharp and small
    image = Image.open(io.BytesIO(png)).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    image.save(out, optimize=True)
    print(f"{out} ({out.stat().st_size // 1024} KB, {image.width}x{image.height})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
