"""The web page's Edit tab (sdlite/server/web/edit.js) in a real browser against ``sdlite serve``.

One server on a free loopback port (:func:`tests.loopback.serve`) offers the shipped demo model and a tiny random
FLUX.2 [klein] (:mod:`tests.test_flux2_pipeline`'s, written as the diffusers folder ``klein`` of its models folder);
each test makes its model the current one through ``/sdapi/v1/options``, as any client may. On klein the tab's edit
(a source picked with the file input, a second image dropped on the tab, a third added and removed) is the image
:class:`sdlite.pipeline.Engine` draws for the same instruction, seed, reference images and steps; on the demo model
the tab says that it is no editing model and sends nothing. The browser helpers are :mod:`tests.test_web_page`'s.
"""
from __future__ import annotations

import base64
import io
import json
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import numpy as np
import pytest

from sdlite.demo import model_path
from sdlite.pipeline import Engine, Request
from tests import test_flux2_pipeline as tiny
from tests.loopback import serve
from tests.test_web_page import TIMEOUT_MS, browser, image_of, open_page, png_file  # noqa: F401 (browser: a fixture)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

INSTRUCTION = "make the circle red"
SOURCE, SECOND, THIRD = tiny._image(96, 64, 1), tiny._image(64, 64, 2), tiny._image(48, 48, 3)
OPTIONS = ["--precision", "exact"]   # the engine below loads the same way


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The models folder; klein is written into it while the server starts (:func:`server`)."""
    return tmp_path_factory.mktemp("web-edit") / "models"


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """``sdlite serve`` with the demo model (current at the start) and the models folder, where klein is built while
    the server starts (both take seconds, on two cores): a model switch to it finds it there (the list is read
    again for a name it does not know)."""
    models.mkdir()
    log_path = tmp_path_factory.mktemp("serve-edit") / "serve.log"
    with ThreadPoolExecutor(1) as pool:
        build = pool.submit(tiny._pipeline, models / "klein")
        with serve(["--model", str(model_path()), "--models-dir", str(models), *OPTIONS], log_path,
                   "/sdapi/v1/samplers") as url:
            build.result()
            yield url


def use_model(server: str, name: str) -> None:
    """Make ``name`` the server's current model (the answer comes once it is loaded)."""
    body = json.dumps({"sd_model_checkpoint": name}).encode()
    request = urllib.request.Request(server + "/sdapi/v1/options", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_MS / 1000) as r:
        assert r.status == 200


@contextmanager
def edit_tab(browser, server, model: str):  # noqa: F811 (browser: the fixture imported above)
    """The page on ``server`` with ``model`` current and the Edit tab shown, chosen with the keyboard (the arrow key
    from the Generate tab), once the tab knows whether the model edits; closed at the end, without JavaScript errors."""
    use_model(server, model)
    page = open_page(browser, server)
    try:
        page.locator("#tab-generate").focus()
        page.keyboard.press("ArrowRight")
        assert page.evaluate("document.activeElement.id") == "tab-edit"
        assert page.locator("#tab-edit").get_attribute("aria-selected") == "true"
        assert page.locator("#edit-form").is_visible() and page.locator("#form").is_hidden()
        page.wait_for_function("document.getElementById('edit-form').dataset.edits !== 'null'")
        yield page
        assert not page.js_errors, f"JavaScript errors on the page: {page.js_errors}"
    finally:
        page.context.close()


def drop_files(page, selector: str, images) -> None:
    """Drop PNG files of ``images`` on the element ``selector``, as a drag from the desktop does."""
    pngs = [base64.b64encode(tiny_png(im)).decode("ascii") for im in images]
    page.evaluate("""([selector, pngs]) => {
        const data = new DataTransfer();
        pngs.forEach((b64, i) => data.items.add(new File([Uint8Array.from(atob(b64), c => c.charCodeAt(0))],
                                                         `dropped${i}.png`, {type: 'image/png'})));
        const zone = document.querySelector(selector);
        zone.dispatchEvent(new DragEvent('dragover', {dataTransfer: data, bubbles: true, cancelable: true}));
        zone.dispatchEvent(new DragEvent('drop', {dataTransfer: data, bubbles: true, cancelable: true}));
    }""", [selector, pngs])


def tiny_png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_demo_model_is_no_editing_model(server, browser):  # noqa: F811
    with edit_tab(browser, server, "demo") as page:
        sent = []
        page.on("request", lambda r: sent.append(r.url) if "img2img" in r.url else None)
        assert page.locator("#edit-form").get_attribute("data-edits") == "false"
        note = page.locator("#edit-model").text_content()
        assert "demo" in note and "not an editing model" in note
        assert "FLUX.2 [klein]" in note and "FLUX.1 Kontext" in note
        assert page.locator("#edit-run").is_disabled()
        # Ctrl+Enter in the instruction does not send it either: the page says why
        page.fill("#edit-prompt", INSTRUCTION)
        page.locator("#edit-prompt").press("Control+Enter")
        page.locator("#error").wait_for()
        assert "Not an editing model" in page.locator("#error").text_content()
        assert sent == []


def test_edit_tab_draws_the_engines_edit(server, models, browser, tmp_path):  # noqa: F811
    with edit_tab(browser, server, "klein") as page:
        edit_with(page, models, tmp_path)


def edit_with(page, models, tmp_path):
    assert page.locator("#edit-form").get_attribute("data-edits") == "true"
    assert "edits from images" in page.locator("#edit-model").text_content()
    unlabelled = page.evaluate("""() => [...document.querySelectorAll('#edit-form input, #edit-form textarea')]
        .filter(e => !e.labels.length && !e.getAttribute('aria-label')).map(e => e.id)""")
    assert unlabelled == []

    # the source by the file picker, image 2 dropped on the tab, image 3 added and removed again
    page.set_input_files("#edit-source", str(png_file(tmp_path / "source.png", SOURCE)))
    page.wait_for_function("document.getElementById('edit-source-size').textContent === '96×64'")
    drop_files(page, "#edit-refs-box", [SECOND])
    page.locator("#edit-refs img").first.wait_for()
    page.set_input_files("#edit-ref", str(png_file(tmp_path / "third.png", THIRD)))
    page.wait_for_function("document.querySelectorAll('#edit-refs img').length === 2")
    assert page.locator("#edit-ref").is_disabled()                  # 3 images in all
    page.get_by_role("button", name="Remove image 3").click()
    assert page.locator("#edit-refs img").count() == 1 and page.locator("#edit-ref").is_enabled()

    page.fill("#edit-prompt", INSTRUCTION)
    page.fill("#edit-seed", "3")
    page.fill("#edit-steps", "2")
    with page.expect_request("**/sdapi/v1/img2img") as request:
        page.click("#edit-run")
    sent = request.value.post_data_json
    assert sent["sdlite_edit"] is True and len(sent["init_images"]) == 2 and sent["steps"] == 2
    assert not {"cfg_scale", "width", "height", "denoising_strength", "mask"} & set(sent)   # the model's, the source's
    page.wait_for_function("!document.getElementById('edit-run').disabled", timeout=TIMEOUT_MS)
    assert page.locator("#error").is_hidden(), page.locator("#error").text_content()
    assert "Done" in page.locator("#status").text_content()

    got = np.asarray(image_of(page.locator("#results img").first))
    assert got.shape == (64, 96, 3)                                 # the source's size
    engine = Engine.load(models / "klein", precision="exact")
    want = engine.generate(Request(INSTRUCTION, seed=3, steps=2, cfg_scale=1.0, sampler="euler",
                                   reference_images=(SOURCE, SECOND))).images[0]
    assert np.array_equal(got, np.asarray(want))
    info = page.locator("#info").text_content()
    assert INSTRUCTION in info and "Seed: 3" in info and "Steps: 2" in info
    assert "edit: " + INSTRUCTION in page.locator("#history button").first.get_attribute("title")

    # the result as the next source; "Reuse all parameters" brings the edit's images and fields back
    page.click("#use-as-source")
    src = page.locator("#results img").first.get_attribute("src")
    assert page.locator("#edit-source-preview").get_attribute("src") == src
    page.fill("#edit-prompt", "something else")
    page.click("#reuse-all")
    assert page.locator("#edit-prompt").input_value() == INSTRUCTION
    assert page.locator("#edit-steps").input_value() == "2" and page.locator("#edit-seed").input_value() == "3"
    assert page.locator("#edit-source-preview").get_attribute("src") != src
    assert page.locator("#edit-refs img").count() == 1
