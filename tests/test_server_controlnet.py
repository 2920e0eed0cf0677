"""A1111's ControlNet extension API on sdlite's server (FastAPI's TestClient, the shipped demo model and two tiny
ControlNets for it, tests/demo_controlnet.py): units in ``alwayson_scripts`` as the extension takes them give the
engine's image for the equivalent ControlUnit, pixel for pixel; the extension's spellings (script names in any case,
empty args, enum strings and integers, old field names, "name [hash]" models) give the same image; bad fields are
refused naming the field and the value; ``/controlnet/detect`` with canny is OpenCV's Canny; the listings have the
extension's shapes."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image, ImageDraw

from sdlite.control import ControlUnit
from sdlite.control.apply import legacy_hash
from sdlite.demo import model_path
from sdlite.pipeline import Engine, Request
from sdlite.server.app import create_app
from sdlite.server.a1111.controlnet import ControlNets
from sdlite.server.limits import Limits
from tests import demo_controlnet as D
from tests.test_server_api import assert_error, b64png, decode, pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPT = "a red circle on a blue background"
SHIPPED = ControlNets().titles()   # the package's demo ControlNets, listed after a folder's
API = "/sdapi/v1"
STEPS = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return D.write(tmp_path_factory.mktemp("controlnets"))


@pytest.fixture(scope="module")
def client(models):
    folder = models["demo-control"].parent
    with TestClient(create_app(controlnet_dir=folder, limits=Limits(max_images=4))) as c:
        yield c


@pytest.fixture(scope="module")
def engine():
    return Engine.load(model_path())


def generate(client, unit=None, scripts=None, route="txt2img", **fields):
    body = {"prompt": PROMPT, "steps": STEPS, "seed": 3, **fields}
    if scripts is not None:
        body["alwayson_scripts"] = scripts
    elif unit is not None:
        body["alwayson_scripts"] = {"controlnet": {"args": [unit] if isinstance(unit, dict) else unit}}
    r = client.post(f"{API}/{route}", json=body)
    info = json.loads(r.json()["info"]) if r.status_code == 200 else None
    return r, info


def first_image(r) -> np.ndarray:
    assert r.status_code == 200, r.text
    return pixels(decode(r.json()["images"][0]))


def unit(picture=None, **fields):
    """A canny unit of demo-control on ``picture`` (default: the shape image); ``fields`` add or replace fields."""
    return {"enabled": True, "module": "canny", "model": "demo-control",
            "image": b64png(picture if picture is not None else D.shape_image()), **fields}


# --- the image: the engine's, for the equivalent ControlUnit ---------------------------------------------------------

def test_a_unit_gives_the_engines_image(client, engine, models):
    cn = {"enabled": True, "module": "canny", "model": f"demo-control [{legacy_hash(models['demo-control'])}]",
          "weight": 0.8, "image": b64png(D.shape_image()), "resize_mode": "Just Resize", "low_vram": False,
          "processor_res": 64, "threshold_a": 50, "threshold_b": 150, "guidance_start": 0.0, "guidance_end": 0.75,
          "control_mode": "Balanced", "pixel_perfect": False, "hr_option": "Both"}
    r, info = generate(client, cn, cfg_scale=7)
    got = first_image(r)
    expected = engine.generate(Request(PROMPT, steps=STEPS, seed=3, cfg_scale=7, sampler="euler", controls=(
        ControlUnit(model=str(models["demo-control"]), image=D.shape_image(), weight=0.8, guidance_end=0.75,
                    preprocessor="canny", resize_mode="just-resize", processor_res=64, threshold_a=50,
                    threshold_b=150),)))
    assert np.array_equal(got, pixels(expected.images[0])), "not the engine's pixels"
    plain = first_image(generate(client)[0])
    assert np.abs(got - plain).mean() > 5, "the control changed nothing"
    text = info["infotexts"][0]
    assert 'ControlNet 0: "Module: canny, Model: demo-control [' in text and "Weight: 0.8" in text
    assert "Threshold A: 50, Threshold B: 150" in text and "Guidance End: 0.75" in text
    assert info["extra_generation_params"]["ControlNet 0"].startswith("Module: canny")
    assert info["warnings"] == []
    # the control map comes back after the image, as the extension sends it: canny's edges at the output size
    images = r.json()["images"]
    assert len(images) == 2 and len(info["infotexts"]) == 1
    edges = pixels(decode(images[1]))
    assert edges.shape == (64, 64, 3) and set(np.unique(edges)) <= {0, 255} and edges.max() == 255


def test_img2img_unit_without_image_uses_the_init_image(client, engine, models):
    source = Image.new("RGB", (80, 64), (0, 0, 255))
    ImageDraw.Draw(source).ellipse((22, 14, 50, 42), fill=(255, 0, 0))
    cn = {"enabled": True, "module": "none", "model": "demo-control", "image": "", "mask": None, "weight": 1.0}
    r, info = generate(client, cn, route="img2img", init_images=[b64png(source)], denoising_strength=0.6,
                       resize_mode=1, width=64, height=64)
    got = first_image(r)
    # the unit takes the init image with the img2img resize mode (1: crop and resize), as the extension does
    expected = engine.generate(Request(PROMPT, steps=STEPS, seed=3, cfg_scale=7, sampler="euler", width=64,
                                       height=64, init_image=source, strength=0.6, resize_mode="crop",
                                       controls=(ControlUnit(model=str(models["demo-control"]),
                                                             resize_mode="crop-and-resize"),)))
    assert np.array_equal(got, pixels(expected.images[0]))
    assert "Resize Mode: Crop and Resize" in info["infotexts"][0]
    # txt2img has no init image: a unit without one is refused by name
    r, _ = generate(client, {"enabled": True, "module": "none", "model": "demo-control"})
    assert_error(r, 422, "alwayson_scripts.controlnet.args[0]", "no control image")


def test_two_units_and_disabled_ones(client, engine, models):
    second = unit(D.noise_image(), model="control_demo_edges", module="none", weight=0.5)
    both = first_image(generate(client, [unit(), second])[0])
    # disabled units are skipped, whatever else they say
    skipped = {"enabled": False, "model": "no-such-model", "module": "no-such-module", "weight": 99}
    r, info = generate(client, [skipped, unit(), None, skipped, second])
    assert np.array_equal(first_image(r), both) and info["warnings"] == []
    assert "ControlNet 1: " in info["infotexts"][0] and "ControlNet 2" not in info["infotexts"][0]
    expected = engine.generate(Request(PROMPT, steps=STEPS, seed=3, cfg_scale=7, sampler="euler", controls=(
        ControlUnit(model=str(models["demo-control"]), image=D.shape_image(), preprocessor="canny"),
        ControlUnit(model=str(models["control_demo_edges"]), image=D.noise_image(), weight=0.5))))
    assert np.array_equal(both, pixels(expected.images[0]))
    # all disabled: the plain image
    r, info = generate(client, [skipped])
    assert np.array_equal(first_image(r), first_image(generate(client)[0]))
    assert len(r.json()["images"]) == 1 and "ControlNet" not in info["infotexts"][0]


def test_script_names_without_case_and_empty_args(client):
    reference = first_image(generate(client, unit())[0])
    for name in ("ControlNet", "controlnet", "CONTROLNET", " Controlnet "):
        r, info = generate(client, scripts={name: {"args": [unit()]}})
        assert np.array_equal(first_image(r), reference), name
        assert info["warnings"] == [], name
    plain = first_image(generate(client)[0])
    for scripts in ({"ControlNet": {"args": []}}, {"controlnet": {}}, {"ControlNet": {"args": None}}):
        r, info = generate(client, scripts=scripts)
        assert np.array_equal(first_image(r), plain) and info["warnings"] == [], scripts
    # other scripts are still ignored with a warning, beside ControlNet's units
    r, info = generate(client, scripts={"ADetailer": {"args": [True]}, "ControlNet": {"args": [unit()]}})
    assert np.array_equal(first_image(r), reference)
    assert info["warnings"] == ["alwayson_scripts ADetailer was ignored: sdlite runs no scripts; of the extensions' "
                                "arguments it takes ControlNet units only"]


@pytest.mark.parametrize("as_int, as_text", [
    ({"control_mode": 1}, {"control_mode": "My prompt is more important"}),
    ({"control_mode": 2}, {"control_mode": "ControlNet is more important"}),
    ({"resize_mode": 2}, {"resize_mode": "Resize and Fill"}),
    ({"resize_mode": 0}, {"resize_mode": "Just Resize"}),
    ({"resize_mode": 1}, {"resize_mode": "Inner Fit (Scale to Fit)"}),       # the old name
    ({"resize_mode": 2}, {"resize_mode": "Outer Fit (Shrink to Fit)"}),
    ({"hr_option": 1}, {"hr_option": "Low res only"}),
])
def test_enum_integers_and_strings_give_the_same_image(client, as_int, as_text):
    wide = D.shape_image(96)   # not square to the output: the resize modes differ
    wide = wide.resize((96, 64))
    a = first_image(generate(client, unit(wide, **as_int))[0])
    b = first_image(generate(client, unit(wide, **as_text))[0])
    assert np.array_equal(a, b)


def test_modes_change_the_image(client):
    wide = D.shape_image(96).resize((96, 64))
    images = {mode: first_image(generate(client, unit(wide, control_mode=mode))[0]) for mode in range(3)}
    assert not np.array_equal(images[0], images[1]) and not np.array_equal(images[1], images[2])
    fits = {mode: first_image(generate(client, unit(wide, resize_mode=mode))[0]) for mode in range(3)}
    assert not np.array_equal(fits[0], fits[1]) and not np.array_equal(fits[1], fits[2])


def test_old_field_names(client):
    image = b64png(D.shape_image())
    new = first_image(generate(client, unit(guidance_end=0.5, low_vram=False))[0])
    old = {"enabled": True, "module": "canny", "model": "demo-control", "input_image": image, "guidance": 0.5,
           "lowvram": False}
    assert np.array_equal(first_image(generate(client, old)[0]), new)
    # guessmode, from before control modes: its successor "ControlNet is more important", with a warning
    control = first_image(generate(client, unit(control_mode="ControlNet is more important"))[0])
    r, info = generate(client, unit(guessmode=True))
    assert np.array_equal(first_image(r), control) and "guessmode" in " ".join(info["warnings"])
    r, info = generate(client, unit(guessmode=False))
    assert info["warnings"] == []
    # image + mask as {"image", "mask"}, as [image, mask], and with mask_image: the same (inpaint)
    mask = Image.new("L", (64, 64), 0)
    ImageDraw.Draw(mask).rectangle((20, 20, 44, 44), fill=255)
    forms = [{"image": {"image": image, "mask": b64png(mask)}}, {"image": [image, b64png(mask)]},
             {"image": image, "mask_image": b64png(mask)}, {"image": image, "mask": b64png(mask)}]
    results = [first_image(generate(client, unit(module="inpaint_only", **form))[0]) for form in forms]
    assert all(np.array_equal(results[0], x) for x in results[1:])
    # a name and its old name together are refused
    r, _ = generate(client, unit(input_image=image))
    assert_error(r, 422, "args[0]", "'input_image'", "'image'")


def test_defaults_of_the_extension(client, engine, models):
    """A unit of only an image and a model: enabled, module none, weight 1, Crop and Resize, Balanced."""
    r, _ = generate(client, {"model": "demo-control", "image": b64png(D.noise_image(seed=4))})
    expected = engine.generate(Request(PROMPT, steps=STEPS, seed=3, cfg_scale=7, sampler="euler", controls=(
        ControlUnit(model=str(models["demo-control"]), image=D.noise_image(seed=4)),)))
    assert np.array_equal(first_image(r), pixels(expected.images[0]))
    # -1 and out-of-range preprocessor values are the preprocessor's defaults, as the extension's bound check
    a = first_image(generate(client, unit(processor_res=-1, threshold_a=-1, threshold_b=-1))[0])
    b = first_image(generate(client, unit(processor_res=512, threshold_a=100, threshold_b=200))[0])
    c = first_image(generate(client, unit(processor_res=5, threshold_a=900, threshold_b=0))[0])
    assert np.array_equal(a, b) and np.array_equal(a, c)
    # pixel_perfect: the resolution from the output size (here 64 for a 64x64 image)
    d = first_image(generate(client, unit(pixel_perfect=True))[0])
    e = first_image(generate(client, unit(processor_res=64))[0])
    assert np.array_equal(d, e)


def test_model_names(client, models):
    listed = client.get("/controlnet/model_list").json()
    titles = [f"control_demo_edges [{legacy_hash(models['control_demo_edges'])}]",
              f"demo-control [{legacy_hash(models['demo-control'])}]"]
    assert listed == {"model_list": titles + SHIPPED}   # the folder's, then the package's demo ControlNets
    assert client.get("/controlnet/model_list", params={"update": "false"}).json() == listed
    reference = first_image(generate(client, unit(model=titles[1]))[0])
    for name in ("demo-control", "DEMO-CONTROL", "demo-control [00000000]", "control"):   # "control": shortest match
        assert np.array_equal(first_image(generate(client, unit(model=name))[0]), reference), name
    assert not np.array_equal(first_image(generate(client, unit(model="edges"))[0]), reference)


@pytest.mark.parametrize("fields, status, words", [
    ({"model": "control_v11p_sd15_depth"}, 404, ["args[0]", "'control_v11p_sd15_depth' not found",
                                                 "available: control_demo_edges [", "demo-control ["]),
    ({"model": "None"}, 422, ["args[0]", "model 'None'", "needs a ControlNet model"]),
    ({"module": "nothing_like_it"}, 422, ["args[0]", "module", "'nothing_like_it'", "available: none, canny"]),
    ({"module": "depth_midas"}, 422, ["args[0]", "'depth_midas'", "annotator"]),
    ({"weight": 3}, 422, ["args[0]", "weight=3", "from 0 to 2"]),
    ({"weight": "heavy"}, 422, ["args[0]", "weight='heavy'"]),
    ({"guidance_start": 0.8, "guidance_end": 0.2}, 422, ["args[0]", "guidance_start (0.8)", "guidance_end (0.2)"]),
    ({"guidance_end": 1.5}, 422, ["args[0]", "guidance_end=1.5"]),
    ({"resize_mode": "Stretch"}, 422, ["args[0]", "resize mode 'Stretch'", "'Just Resize'"]),
    ({"control_mode": 7}, 422, ["args[0]", "control mode 7"]),
    ({"control_mode": "Louder"}, 422, ["args[0]", "control mode 'Louder'", "'ControlNet is more important'"]),
    ({"hr_option": "Sometimes"}, 422, ["args[0]", "hr_option 'Sometimes'", "'Low res only'"]),
    ({"image": "not base64!"}, 422, ["args[0].image", "not valid base64"]),
    ({"image": 42}, 422, ["args[0].image", "expected a base64-encoded image"]),
    ({"enabled": "yes"}, 422, ["args[0]", "enabled='yes'"]),
    ({"pixel_perfect": "no"}, 422, ["args[0]", "pixel_perfect='no'"]),
    ({"processor_res": "big"}, 422, ["args[0]", "processor_res='big'"]),
])
def test_bad_fields_are_named(client, fields, status, words):
    r, _ = generate(client, [unit(), unit(**fields)] if "model" not in fields else unit(**fields))
    assert_error(r, status, *[w.replace("args[0]", "args[1]") if "model" not in fields else w for w in words])


def test_bad_structures_are_named(client):
    r, _ = generate(client, scripts={"controlnet": {"args": {"enabled": True}}})
    assert_error(r, 422, "alwayson_scripts.controlnet.args", "expected a list")
    r, _ = generate(client, scripts={"ControlNet": [unit()]})
    assert_error(r, 422, "alwayson_scripts.ControlNet", "\"args\"")
    r, _ = generate(client, unit(image=[b64png(D.shape_image())] * 3))
    assert_error(r, 422, "args[0].image", "a list of 3 images")
    r, _ = generate(client, [unit()] * 9)
    assert_error(r, 422, "9 enabled ControlNet units", "at most 8")
    r, info = generate(client, ["a string", unit()])
    assert r.status_code == 200 and "args[0]: str 'a string' was ignored" in info["warnings"][0]
    mask = b64png(Image.new("L", (32, 32), 255))
    r, _ = generate(client, unit(module="inpaint", mask=mask))
    assert_error(r, 422, "args[0].mask", "32x32", "64x64")


def test_control_maps_can_be_left_out(client):
    r, _ = generate(client, unit(save_detected_map=False))
    assert len(r.json()["images"]) == 1
    assert client.post(f"{API}/options", json={"control_net_no_detectmap": True}).json() == {}
    try:
        r, _ = generate(client, unit())
        assert len(r.json()["images"]) == 1
    finally:
        client.post(f"{API}/options", json={"control_net_no_detectmap": False})
    r, _ = generate(client, unit(), send_images=False)
    assert r.json()["images"] == []


def test_hires_fix_with_a_unit(client, engine, models):
    from sdlite.hires import Hires

    r, info = generate(client, unit(hr_option="High res only"), enable_hr=True, hr_scale=2, hr_upscaler="Latent",
                       denoising_strength=0.5, hr_second_pass_steps=2)
    expected = engine.generate(Request(PROMPT, steps=STEPS, seed=3, cfg_scale=7, sampler="euler",
                                       hires=Hires(scale=2, upscaler="Latent", denoise=0.5, steps=2),
                                       controls=(ControlUnit(model=str(models["demo-control"]), image=D.shape_image(),
                                                             preprocessor="canny", hr_option="high-res-only"),)))
    assert np.array_equal(first_image(r), pixels(expected.images[0]))
    assert "Hr Option: High res only" in info["infotexts"][0]
    sizes = [decode(b).size for b in r.json()["images"]]
    assert sizes == [(128, 128), (128, 128)]    # the image, then the map the second pass used (the only one)


# --- /controlnet/detect ---------------------------------------------------------------------------------------------

def opencv_canny(image: Image.Image, res: int, low: int, high: int) -> np.ndarray:
    """The extension's canny, written out with OpenCV: the short side scaled to ``res`` (area to shrink, cubic to
    enlarge), edge-padded to multiples of 64, Canny, the padding cropped off."""
    import cv2

    x = np.asarray(image.convert("RGB"))
    h, w = x.shape[:2]
    k = res / min(h, w)
    th, tw = int(np.round(h * k)), int(np.round(w * k))
    x = cv2.resize(x, (tw, th), interpolation=cv2.INTER_CUBIC if k > 1 else cv2.INTER_AREA)
    x = np.pad(x, [[0, math.ceil(th / 64) * 64 - th], [0, math.ceil(tw / 64) * 64 - tw], [0, 0]], mode="edge")
    return cv2.Canny(x, low, high)[:th, :tw]


@pytest.mark.parametrize("size, res, low, high", [((64, 64), 64, 100, 200), ((90, 70), 128, 50, 120),
                                                  ((200, 150), 96, 100, 200)])
def test_detect_canny_is_opencvs(client, size, res, low, high):
    from sdlite.control import preprocess

    image = D.shape_image(200).resize(size, Image.Resampling.BILINEAR)
    r = client.post("/controlnet/detect", json={"controlnet_module": "canny", "controlnet_input_images":
                                                [b64png(image)], "controlnet_processor_res": res,
                                                "controlnet_threshold_a": low, "controlnet_threshold_b": high})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["info"] == "Success" and len(body["images"]) == 1
    got = pixels(decode(body["images"][0]))
    expected = opencv_canny(image, res, low, high)
    assert got.shape[:2] == expected.shape and (got == expected[:, :, None]).all()
    assert expected.max() == 255   # there are edges
    assert np.array_equal(got, pixels(preprocess.run("canny", image, res, low, high)))


def test_detect_old_field_names_defaults_and_errors(client):
    image = D.shape_image(64)
    # webuiapi sends controlnet_images (the older name) and data URIs; -1 and missing values are the defaults
    r = client.post("/controlnet/detect", json={"controlnet_module": "canny", "controlnet_images": [
        "data:image/png;base64," + b64png(image), b64png(D.noise_image())]})
    assert r.status_code == 200, r.text
    got = [pixels(decode(b)) for b in r.json()["images"]]
    assert len(got) == 2 and (got[0] == opencv_canny(image, 512, 100, 200)[:, :, None]).all()
    r = client.post("/controlnet/detect", json={"controlnet_module": "invert", "controlnet_input_images":
                                                [b64png(image)], "controlnet_processor_res": -1})
    assert np.array_equal(pixels(decode(r.json()["images"][0])), 255 - pixels(image))
    assert_error(client.post("/controlnet/detect", json={"controlnet_module": "depth_midas",
                                                         "controlnet_input_images": [b64png(image)]}),
                 422, "'depth_midas'", "annotator")
    assert_error(client.post("/controlnet/detect", json={"controlnet_module": "cany",
                                                         "controlnet_input_images": [b64png(image)]}),
                 422, "controlnet_module", "'cany'", "available: none, canny")
    assert_error(client.post("/controlnet/detect", json={"controlnet_module": "canny"}), 422, "No image selected")
    assert_error(client.post("/controlnet/detect", json={"controlnet_module": "canny",
                                                         "controlnet_input_images": ["%%%"]}),
                 422, "controlnet_input_images[0]")
    assert_error(client.post("/controlnet/detect", json={"controlnet_module": "canny",
                                                         "controlnet_input_images": [b64png(image)] * 5}),
                 422, "5 images", "--max-images")


# --- the listings ---------------------------------------------------------------------------------------------------

def test_listings_have_the_extensions_shapes(client):
    assert client.get("/controlnet/version").json() == {"version": 3}
    assert client.get("/controlnet/settings").json() == {"control_net_unit_count": 3}
    modules = client.get("/controlnet/module_list").json()
    assert modules["module_list"][:2] == ["none", "canny"] and "depth_midas" in modules["module_list"]
    detail = modules["module_detail"]
    assert set(detail) == set(modules["module_list"])
    assert detail["none"] == {"model_free": True, "sliders": []}
    assert [s["name"] for s in detail["canny"]["sliders"]] == ["Resolution", "Low Threshold",
                                                              "High Threshold"]
    assert detail["canny"]["sliders"][0] == {"name": "Resolution", "value": 512, "min": 64, "max": 2048, "step": 8}
    assert detail["canny"]["sliders"][1]["value"] == 100 and detail["canny"]["sliders"][2]["value"] == 200
    assert detail["depth_midas"]["model_free"] is False
    aliased = client.get("/controlnet/module_list", params={"alias_names": "true"}).json()
    assert "invert (from white bg & black line)" in aliased["module_list"]
    types = client.get("/controlnet/control_types").json()["control_types"]
    assert list(types)[0] == "All" and {"Canny", "Depth", "Inpaint", "Tile/Blur"} <= set(types)
    assert set(types["Canny"]) == {"module_list", "model_list", "default_option", "default_model"}
    assert types["Canny"]["module_list"][0] == "none" and types["Canny"]["default_option"] == "canny"
    assert types["All"]["model_list"][0] == "None" and len(types["All"]["model_list"]) == 3 + len(SHIPPED)
    assert types["Canny"]["model_list"] == ["None"] and types["Canny"]["default_model"] == "None"
    assert client.get(f"{API}/scripts").json() == {"txt2img": ["controlnet"], "img2img": ["controlnet"]}


def test_no_controlnet_dir_and_auth(tmp_path):
    with TestClient(create_app(api_auth="me:secret", preload=False)) as c:
        assert c.get("/controlnet/model_list").status_code == 401
        auth = ("me", "secret")
        assert c.get("/controlnet/model_list", auth=auth).json() == {"model_list": SHIPPED}
        r = c.post(f"{API}/txt2img", auth=auth, json={"prompt": PROMPT, "steps": 2, "alwayson_scripts": {
            "ControlNet": {"args": [unit()]}}})
        assert_error(r, 404, "'demo-control' not found", "--controlnet-dir")
        assert c.post("/controlnet/detect", json={}).status_code == 401


@pytest.mark.skipif(not SHIPPED, reason="the package's demo ControlNet is not installed")
def test_the_shipped_demo_controlnet_is_offered(client):
    """Without a folder of its own the server offers the package's demo ControlNet for the demo model, by name."""
    name = SHIPPED[0].split(" [")[0]
    position = Image.new("RGB", (64, 64), (0, 0, 0))
    ImageDraw.Draw(position).ellipse((8, 8, 28, 28), fill=(255, 255, 255))
    r, info = generate(client, {"model": name, "module": "none", "image": b64png(position)})
    assert r.status_code == 200, r.text
    assert f"Model: {SHIPPED[0]}" in info["infotexts"][0]
