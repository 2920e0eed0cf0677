"""The web page of ``sdlite serve`` (sdlite/server/web), in a real browser against the real server.

Debian's chromium (installed by ``make setup``; Playwright's own browser download cannot work offline) is
driven by Playwright's sync API, headless, against ``sdlite serve`` started as a subprocess on a free loopback
port with the shipped demo model. The page's images are decoded from their data URIs and judged by the demo's
automatic classifier (sdlite.demo.classify), so a pass means the pixels really came from the model.
"""
from __future__ import annotations

import base64
import io
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from sdlite.demo import DEFAULT_PROMPT
from sdlite.demo import data as D
from sdlite.demo.classify import classify
from tests import demo_controlnet
from tests.loopback import CHROMIUM, CHROMIUM_ARGS, serve

from playwright import sync_api  # noqa: E402  (the test extra; the browser is Debian's chromium, see below)

SEED = 3                 # the demo draws a red circle on blue for this seed (checked with Engine directly)
PROGRESS_STEPS = 100     # enough that the page's 0.2 s progress polls catch the run part way (~1.5 s idle)
TIMEOUT_MS = 180_000     # for any one thing the page has to show (a busy 2-core machine is slow)
IDS = ["prompt", "negative", "steps", "cfg", "sampler", "seed", "width", "height", "batch", "generate",
       "interrupt", "progress", "eta", "results", "history"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """``sdlite serve`` with the demo model on a free loopback port; stopped (and its log shown) at the end."""
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    controlnets = tmp_path_factory.mktemp("controlnets")
    demo_controlnet.write(controlnets)   # two tiny ControlNets for the demo model, for the ControlNet panel
    # --max-steps: the interrupt test runs 1000 steps, over the server's default limit of 150
    with serve(["--max-steps", "1000", "--controlnet-dir", str(controlnets)], log_path, "/sdapi/v1/samplers") as url:
        yield url


@pytest.fixture(scope="module")
def browser():
    assert CHROMIUM, "Debian's chromium is not installed: make setup installs it (apt-get install chromium)"
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, timeout=TIMEOUT_MS)
        yield b
        b.close()


def open_page(browser, server, width=1200, height=800):
    context = browser.new_context(viewport={"width": width, "height": height})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.js_errors = []
    page.on("pageerror", lambda e: page.js_errors.append(str(e)))
    page.goto(server + "/")
    # the server's lists (samplers, upscalers, ControlNet models ...) load one after another: all of them, before a
    # test reads one
    page.wait_for_function("document.body.dataset.serverInfo === 'loaded'")
    return page


@pytest.fixture
def page(browser, server):
    page = open_page(browser, server)
    yield page
    errors = page.js_errors
    page.context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def image_of(img) -> Image.Image:
    """The pixels an <img> shows, from its data URI."""
    src = img.get_attribute("src")
    assert src.startswith("data:image/png;base64,"), src[:40]
    return Image.open(io.BytesIO(base64.b64decode(src.split(",", 1)[1]))).convert("RGB")


def wait_idle(page, timeout=TIMEOUT_MS):
    """Until the generation in flight has finished (the Generate button is enabled again)."""
    page.wait_for_function("!document.getElementById('generate').disabled", timeout=timeout)


def watch_progress(page):
    """Record every value the progress bar, every text the ETA line and every image the live preview take."""
    page.evaluate("""() => {
        window.seenProgress = []; window.seenEta = []; window.seenPreview = [];
        const bar = document.getElementById('progress'), eta = document.getElementById('eta');
        const preview = document.getElementById('preview');
        new MutationObserver(() => window.seenPreview.push(preview.src))
            .observe(preview, {attributes: true, attributeFilter: ['src']});
        new MutationObserver(() => window.seenProgress.push(bar.value))
            .observe(bar, {attributes: true, attributeFilter: ['value']});
        new MutationObserver(() => window.seenEta.push(eta.textContent))
            .observe(eta, {childList: true, characterData: true, subtree: true});
    }""")


def png_file(path: Path, image: Image.Image) -> Path:
    image.save(path)
    return path


# --- the page ----------------------------------------------------------------------------------------------------


def test_page_has_its_controls_labelled(page):
    for name in IDS:
        assert page.locator(f"#{name}").count() == 1, name
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('input, select, textarea')]
        .filter(e => !e.labels.length && !e.getAttribute('aria-label')).map(e => e.id)""")
    assert unlabelled == []
    assert page.get_by_label("Prompt", exact=True).get_attribute("id") == "prompt"
    names = page.locator("#sampler option").all_text_contents()
    assert "Euler a" in names and page.locator("#sampler").input_value() in names
    assert page.locator("#interrupt").is_disabled()


def test_generate_shows_progress_and_the_models_image(page):
    page.fill("#prompt", DEFAULT_PROMPT)
    page.fill("#steps", str(PROGRESS_STEPS))
    page.fill("#seed", str(SEED))
    watch_progress(page)
    page.click("#generate")
    page.locator("#results img").first.wait_for()
    wait_idle(page)

    seen = page.evaluate("window.seenProgress")
    assert any(0 < v < 1 for v in seen), f"the progress bar never showed a value between 0 and 1: {seen}"
    assert seen[-1] == 1
    etas = page.evaluate("window.seenEta")
    assert any(f"/{PROGRESS_STEPS}" in t for t in etas), etas      # "Step 37/150 · ETA 1.9 s"
    previews = page.evaluate("window.seenPreview")                 # the server's default: every 10 steps
    assert any(p.startswith("data:image/png;base64,") for p in previews), previews

    images = page.locator("#results img")
    assert images.count() == 1
    image = image_of(images.first)
    assert image.size == (64, 64)                                  # the demo model's native size
    assert classify(image).combo == ("red", "circle", "blue")
    info = page.locator("#info").text_content()
    assert DEFAULT_PROMPT in info and f"Seed: {SEED}" in info and f"Steps: {PROGRESS_STEPS}" in info
    assert "Done" in page.locator("#status").text_content()
    assert page.locator("#error").is_hidden()

    # the history keeps it: clicking shows its parameters again, and its seed can be reused
    assert page.locator("#history img").count() == 1
    page.fill("#seed", "-1")
    page.locator("#history button").first.click()
    assert f"Seed: {SEED}" in page.locator("#info").text_content()
    page.click("#reuse-seed")
    assert page.locator("#seed").input_value() == str(SEED)


def test_batch_and_random_seed_fill_the_history(page):
    page.fill("#prompt", "a yellow square on a green background")
    page.fill("#batch", "2")
    page.click("#generate")
    wait_idle(page)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
    assert page.locator("#results img").count() == 2
    seeds = [int(t.split()[-1]) for t in page.locator("#results figcaption").all_text_contents()]
    assert seeds[1] == seeds[0] + 1 and seeds[0] >= 0               # -1 was resolved to a random seed
    page.fill("#batch", "1")
    page.fill("#seed", str(seeds[1]))
    page.click("#generate")
    wait_idle(page)
    assert page.locator("#history img").count() == 3
    # the same seed alone gives the second image of the batch again (to a rounding step: batched float sums)
    history = page.locator("#history img")
    alone, batched = (np.asarray(image_of(history.nth(i)), dtype=int) for i in (0, 1))
    assert np.abs(alone - batched).max() <= 2
    # "Reuse all parameters" of the batch's first image puts its prompt and seed back in the form
    page.fill("#prompt", "something else")
    page.locator("#history button").nth(2).click()
    page.click("#reuse-all")
    assert page.locator("#prompt").input_value() == "a yellow square on a green background"
    assert page.locator("#seed").input_value() == str(seeds[0]) and page.locator("#batch").input_value() == "1"


def test_interrupt_stops_a_long_run(page):
    page.fill("#prompt", DEFAULT_PROMPT)
    page.fill("#steps", "1000")
    page.fill("#batch", "4")           # a minute or more if it were not interrupted
    page.click("#generate")
    assert page.locator("#interrupt").is_enabled()
    page.wait_for_function("document.getElementById('progress').value > 0")
    start = time.monotonic()
    page.click("#interrupt")
    wait_idle(page, timeout=30_000)
    assert time.monotonic() - start < 20
    assert "Interrupted" in page.locator("#status").text_content()
    assert page.locator("#interrupt").is_disabled()
    # the server is free again: the next generation runs normally
    page.fill("#steps", "20")
    page.fill("#batch", "1")
    page.fill("#seed", str(SEED))
    page.click("#generate")
    wait_idle(page)
    assert "Done" in page.locator("#status").text_content()
    assert classify(image_of(page.locator("#results img").first)).combo == ("red", "circle", "blue")


def test_server_errors_are_shown(page):
    # an unknown sampler, sent as if the select had it: the server's message is shown, the page stays usable
    page.evaluate("""() => {
        const s = document.getElementById('sampler');
        s.append(new Option('No Such Sampler', 'No Such Sampler')); s.value = 'No Such Sampler';
    }""")
    page.fill("#prompt", DEFAULT_PROMPT)
    page.click("#generate")
    error = page.locator("#error")
    error.wait_for()
    assert "No Such Sampler" in error.text_content() and "sampler" in error.text_content().lower()
    wait_idle(page)
    assert page.locator("#prompt").is_visible() and page.locator("#results img").count() == 0

    # a size the browser's own checks would stop (not a multiple of 8), sent anyway: the server refuses it
    page.select_option("#sampler", "Euler a")
    page.evaluate("document.getElementById('width').removeAttribute('step')")
    page.fill("#width", "100")
    page.click("#generate")
    page.wait_for_function("document.getElementById('error').textContent.includes('100')")
    wait_idle(page)
    assert "8" in error.text_content()      # "... must be a multiple of 8"


def test_server_warnings_are_shown(page):
    """A scheduler sdlite does not have runs with Automatic instead; the server's warning is shown, no error."""
    page.evaluate("""() => {
        const s = document.getElementById('scheduler');
        s.append(new Option('Polyexponential', 'polyexponential')); s.value = 'polyexponential';
    }""")
    page.fill("#prompt", DEFAULT_PROMPT)
    page.click("#generate")
    wait_idle(page)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
    assert page.locator("#results img").count() == 1
    assert "Polyexponential" in page.locator("#warnings").text_content()
    page.select_option("#scheduler", "")
    page.click("#generate")
    wait_idle(page)
    assert page.locator("#warnings").is_hidden()


def test_form_checks_before_sending(page):
    requests = []
    page.on("request", lambda r: requests.append(r.url) if "txt2img" in r.url else None)
    page.fill("#width", "13")
    page.click("#generate")
    page.locator("#error").wait_for()
    assert "Width" in page.locator("#error").text_content()
    assert requests == []


@pytest.mark.parametrize("status, body, expected", [
    (503, '{"error": "QueueFull", "detail": "the queue is full (4 jobs waiting)"}', ["busy", "queue is full"]),
    (422, '{"detail": [{"loc": ["body", "steps"], "msg": "Input should be a valid integer", "type": "int_parsing"}]}',
     ["steps: Input should be a valid integer"]),
    (500, "Internal Server Error", ["500", "Internal Server Error"]),
])
def test_error_answers_are_readable(page, status, body, expected):
    """Whatever the server answers (its JSON errors, FastAPI's validation lists, plain text), the page shows it."""
    page.route("**/sdapi/v1/txt2img", lambda route: route.fulfill(status=status, body=body,
                                                                   content_type="application/json"))
    page.fill("#prompt", DEFAULT_PROMPT)
    page.click("#generate")
    page.locator("#error").wait_for()
    text = page.locator("#error").text_content()
    for piece in expected:
        assert piece in text, text
    wait_idle(page)


def test_inpainting_from_uploaded_source_and_mask(page, tmp_path):
    """A red circle, masked, repainted as a yellow star (what the demo does with these inputs, see
    tests/test_demo_img2img.py); the files go to /img2img as data URIs with the inpainting options."""
    source = png_file(tmp_path / "source.png",
                      Image.fromarray(D.render(D.Scene("red", "circle", "blue", cx=32, cy=32, size=28))))
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle([16, 16, 47, 47], fill=255)
    mask = png_file(tmp_path / "mask.png", mask)

    page.click("#img2img summary")
    page.set_input_files("#init-image", str(source))
    page.set_input_files("#mask", str(mask))
    page.locator("#init-preview").wait_for()
    page.locator("#mask-preview").wait_for()
    page.fill("#prompt", "a yellow star on a blue background")
    page.fill("#seed", "0")
    page.fill("#denoising", "0.75")
    page.select_option("#inpainting-fill", "1")
    with page.expect_request("**/sdapi/v1/img2img") as request:
        page.click("#generate")
    sent = request.value.post_data_json
    assert sent["init_images"][0].startswith("data:image/png;base64,")
    assert sent["mask"].startswith("data:image/png;base64,")
    assert sent["denoising_strength"] == 0.75 and sent["inpainting_fill"] == 1
    assert sent["mask_blur"] == 4 and sent["inpainting_mask_invert"] == 0
    wait_idle(page)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
    result = image_of(page.locator("#results img").first)
    got = classify(result)
    assert got.background == "blue" and got.colour == "yellow", got.combo

    # "Use as source image" takes a result as the next source; clearing goes back to text to image
    page.click("#use-as-source")
    assert page.locator("#init-preview").get_attribute("src") == page.locator("#results img").first.get_attribute("src")
    page.click("#clear-sources")
    with page.expect_request("**/sdapi/v1/txt2img"):
        page.click("#generate")
    wait_idle(page)


def test_narrow_window_and_keyboard(browser, server):
    page = open_page(browser, server, width=380, height=800)
    try:
        assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        for name in ["prompt", "generate", "progress", "history"]:
            page.locator(f"#{name}").scroll_into_view_if_needed()
            assert page.locator(f"#{name}").is_visible(), name
        # keyboard only: type the prompt, Ctrl+Enter generates
        page.locator("#prompt").focus()
        page.keyboard.type(DEFAULT_PROMPT)
        page.keyboard.press("Tab")                         # to the negative prompt
        assert page.evaluate("document.activeElement.id") == "negative"
        page.keyboard.press("Control+Enter")
        page.locator("#results img").first.wait_for()
        wait_idle(page)
        # Generate pressed with the keyboard: focus moves to Interrupt while running, and back after
        page.locator("#generate").focus()
        page.keyboard.press("Enter")
        assert page.evaluate("document.activeElement.id") in ("interrupt", "generate")   # may finish at once
        wait_idle(page)
        assert page.evaluate("document.activeElement.id") == "generate"
        assert page.locator("#history img").count() == 2
        assert page.evaluate("document.documentElement.scrollWidth <= document.documentElement.clientWidth")
        assert not page.js_errors, page.js_errors
    finally:
        page.context.close()


def test_hires_fix_and_upscale_controls(page):
    """The hires panel sends enable_hr with the upscaler chosen from the server's lists; the upscale panel sends the
    selected image to /extra-single-image. Both images come back at the larger size, still the demo's colours."""
    page.click("#hires-box summary")
    options = page.locator("#hr-upscaler option").all_text_contents()
    assert options[:2] == ["Latent", "Latent (antialiased)"] and "Lanczos" in options
    page.fill("#prompt", DEFAULT_PROMPT)
    page.fill("#steps", "20")
    page.fill("#seed", str(SEED))
    page.check("#hires")
    page.select_option("#hr-upscaler", "Lanczos")
    page.fill("#hr-denoise", "0.5")
    page.click("#generate")
    page.locator("#results img").first.wait_for()
    wait_idle(page)
    image = image_of(page.locator("#results img").first)
    assert image.size == (128, 128)
    found = classify(image)
    assert (found.colour, found.background) == ("red", "blue"), found.combo
    info = page.locator("#info").text_content()
    assert "Hires upscale: 2" in info and "Hires upscaler: Lanczos" in info

    page.click("#upscale-box summary")
    page.select_option("#extras-upscaler", "Lanczos")
    page.fill("#extras-scale", "2")
    page.click("#upscale-selected")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Upscaled')",
                           timeout=TIMEOUT_MS)
    upscaled = image_of(page.locator("#results img").first)
    assert upscaled.size == (256, 256)
    assert "Postprocess upscaler: Lanczos" in page.locator("#info").text_content()
    assert page.locator("#error").is_hidden()


def test_controlnet_panel_sends_a_unit(page, server, tmp_path):
    """The ControlNet panel lists the server's models (/controlnet/model_list) and its preprocessors that need no
    annotator (/controlnet/module_list); an uploaded control image goes out as one unit of A1111's extension with
    the model, preprocessor, weight, start and end chosen; the image that comes back is the one the same request
    gives through the API, shown with its parameters and the control map after it."""
    import json as _json

    control = png_file(tmp_path / "control.png", demo_controlnet.shape_image())
    page.click("#controlnet-box summary")
    models = page.locator("#cn-model option").all_text_contents()
    demo = next(m for m in models if m.startswith("demo-control ["))
    assert models[0] == "None" and {m.split(" [")[0] for m in models[1:3]} == {"demo-control", "control_demo_edges"}
    modules = page.locator("#cn-module option").all_text_contents()
    assert modules[:2] == ["none", "canny"] and "depth_midas" not in modules
    assert not page.locator("#cn-enabled").is_checked()
    page.set_input_files("#cn-image", str(control))
    page.locator("#cn-preview").wait_for()
    assert page.locator("#cn-enabled").is_checked()        # choosing an image turns the panel on
    page.select_option("#cn-model", demo)
    page.select_option("#cn-module", "canny")
    page.fill("#cn-weight", "0.8")
    page.fill("#cn-start", "0.1")
    page.fill("#cn-end", "0.75")
    page.fill("#prompt", DEFAULT_PROMPT)
    page.fill("#steps", "10")
    page.fill("#seed", str(SEED))
    with page.expect_request("**/sdapi/v1/txt2img") as request:
        page.click("#generate")
    sent = request.value.post_data_json
    unit = sent["alwayson_scripts"]["controlnet"]["args"][0]
    assert unit["enabled"] is True and unit["model"] == demo and unit["module"] == "canny"
    assert (unit["weight"], unit["guidance_start"], unit["guidance_end"]) == (0.8, 0.1, 0.75)
    assert unit["image"].startswith("data:image/png;base64,")
    wait_idle(page)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
    result = image_of(page.locator("#results figure:not(.control-map) img").first)
    edges = np.asarray(image_of(page.locator("#results figure.control-map img")))
    assert edges.shape == (64, 64, 3) and set(np.unique(edges)) == {0, 255}   # canny's map of the control image
    info = page.locator("#info").text_content()
    assert 'ControlNet 0: "Module: canny, Model: demo-control [' in info
    assert "Weight: 0.8" in info and "Guidance Start: 0.1" in info and "Guidance End: 0.75" in info
    assert page.locator("#history img").count() == 1                       # the map is not a result
    # the same JSON through the API gives the same pixels
    req = urllib.request.Request(server + "/sdapi/v1/txt2img", data=_json.dumps(sent).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=TIMEOUT_MS / 1000) as r:
        body = _json.loads(r.read())
    direct = Image.open(io.BytesIO(base64.b64decode(body["images"][0]))).convert("RGB")
    assert np.array_equal(np.asarray(direct), np.asarray(result))
    # "Reuse all parameters" puts the unit back; turning the panel off sends no unit
    page.fill("#cn-weight", "1.5")
    page.click("#reuse-all")
    assert page.locator("#cn-weight").input_value() == "0.8"
    page.uncheck("#cn-enabled")
    with page.expect_request("**/sdapi/v1/txt2img") as request:
        page.click("#generate")
    assert "alwayson_scripts" not in request.value.post_data_json
    wait_idle(page)
    assert page.locator("#results figure.control-map").count() == 0

