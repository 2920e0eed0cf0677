"""Qwen-Image-Lightning (lightx2v's 4- and 8-step LoRAs): a LoRA whose file is named like one switches the run to the
scheduler config its model card samples it with (base_shift = max_shift = log 3, dynamic shifting, no
shift_terminal) and, where a front-end leaves them unset, to its steps and cfg 1.

* the schedule's sigmas equal diffusers' ``FlowMatchEulerDiscreteScheduler(**lightning config)`` over the pipeline's
  sigmas ``linspace(1, 1/steps, steps)`` at the ``mu`` QwenImagePipeline computes from the image's token count;
* end to end on the tiny random model of tests/test_qwenimage_pipeline.py: a LoRA in lightx2v's layout (bare module
  paths, ``lora_down`` / ``lora_up``) named ``Qwen-Image-Lightning-8steps-V1.1``, given by a prompt tag, equals
  ``QwenImagePipeline`` with that scheduler and the LoRA fused (steps given by the request win over the name's 8);
  the same file under another name keeps the model's schedule, which misses the Lightning images;
* the defaults the front-ends fill unset fields with (``Family.sampling_defaults_for``, the CLI's)."""
from __future__ import annotations

import argparse
import shutil

import numpy as np
import pytest
import torch

from sdlite.config.qwenimage import QWEN_IMAGE_LIGHTNING_SCHEDULER, QWEN_IMAGE_SCHEDULER
from sdlite.pipeline import Engine, Request
from sdlite.sampling.samplers import plan
from tests.reference import fused_lora_images, lora_factors, lora_request, write_lora
from tests.test_qwenimage_pipeline import MAX_PIXEL_DIFF, PROMPT, _pipeline, _pixels

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SIZE = 64
LIGHTNING_8 = "Qwen-Image-Lightning-8steps-V1.1"


def _diffusers_config() -> dict:
    return {k: v for k, v in QWEN_IMAGE_LIGHTNING_SCHEDULER.items() if not k.startswith("_")}


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """(pipeline with the Lightning scheduler, engine, the LoRA folder, the Lightning file)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    tmp = tmp_path_factory.mktemp("qwenimage_lightning")
    pipe = _pipeline(tmp / "qwen-image")
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**_diffusers_config())
    loras = tmp / "loras"
    loras.mkdir()
    factors = lora_factors(sorted(pipe.transformer.named_modules()), 13)
    path = write_lora(loras / f"{LIGHTNING_8}.safetensors", factors, parts="lora_down")
    return pipe, Engine.load(tmp / "qwen-image", precision="exact"), loras, path


@pytest.mark.parametrize("width,height,steps", [(1328, 1328, 8), (1664, 928, 4), (96, 64, 8)])
def test_sigmas_equal_diffusers_with_the_lightning_config(qwen, width, height, steps):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift

    _, engine, _, _ = qwen
    reference = FlowMatchEulerDiscreteScheduler(**_diffusers_config())
    cfg = reference.config
    tokens = (height // 16) * (width // 16)   # the packed latent's length, as the pipeline reads it
    mu = calculate_shift(tokens, cfg.base_image_seq_len, cfg.max_image_seq_len, cfg.base_shift, cfg.max_shift)
    reference.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)
    request = Request(prompt=f"a cat <lora:{LIGHTNING_8}:1>", width=width, height=height, steps=steps,
                      sampler="euler")
    got = plan("euler", engine.schedule_for(request), steps, None, None).sigmas
    torch.testing.assert_close(got, reference.sigmas.to(got.dtype), rtol=0, atol=1e-7)
    # shift 3 at every size (mu = log 3), no stretch to 0.02: not the model's own schedule
    plain = plan("euler", engine.schedule_for(request.replace(prompt="a cat")), steps, None, None).sigmas
    assert float(plain[-2]) == pytest.approx(QWEN_IMAGE_SCHEDULER["shift_terminal"], abs=1e-6)
    assert float((got - plain).abs().max()) > 0.01
    # ComfyUI's sampling keeps the graph's (its ModelSampling nodes), as ComfyUI does
    comfy = engine.schedule_for(request.replace(noise="comfy"))
    assert comfy.shift_terminal == pytest.approx(QWEN_IMAGE_SCHEDULER["shift_terminal"])


def test_lightning_lora_run_equals_diffusers_with_its_scheduler(qwen, tmp_path):
    """3 Euler steps (given: the name's 8 do not override them), batch 2, the LoRA by its prompt tag: diffusers'
    pipeline with the Lightning scheduler and the LoRA fused. Renamed, the same file keeps Qwen-Image's schedule."""
    pipe, engine, loras, path = qwen
    expected = fused_lora_images(pipe, PROMPT, SIZE, path, 1.0)
    result = engine.generate(lora_request(f"{PROMPT} <lora:{LIGHTNING_8}:1>", SIZE, lora_dir=str(loras)))
    got = _pixels(result.images)
    assert np.abs(got - expected).max() <= MAX_PIXEL_DIFF
    assert got.std() > 10, "the images should not be flat"
    note = [w for w in result.warnings if "Qwen-Image-Lightning" in w]
    assert len(note) == 1 and LIGHTNING_8 in note[0] and "8 steps at cfg 1" in note[0] and "3 steps" in note[0]
    assert result.infotext["Lora hashes"].startswith(f"{LIGHTNING_8}: ")
    renamed = shutil.copy(path, tmp_path / "style.safetensors")
    other = engine.generate(lora_request(PROMPT, SIZE, loras=((renamed, 1.0),)))
    assert np.abs(_pixels(other.images) - expected).max() > 10, "the schedule should matter"
    assert not any("Lightning" in w for w in other.warnings)


def test_defaults_for_a_lightning_lora(qwen):
    """The front-ends' defaults: the name's steps and cfg 1 with a Lightning LoRA, the model card's without; the CLI
    fills only what its flags leave unset."""
    from sdlite.cli.generate import _resolve_turbo_defaults

    _, engine, loras, path = qwen
    family = engine.family
    assert family.sampling_defaults_for([]) == family.sampling_defaults
    assert family.sampling_defaults_for(["style", "Qwen-Image-Edit-2509-Lightning-4steps-V1.0-bf16"]) == \
        {**family.sampling_defaults, "steps": 4, "cfg": 1.0}
    assert family.lora_sampling(["Qwen-Image-Lightning"]) is None   # no step count in the name: not taken for one

    def args(**kw):
        return argparse.Namespace(**{"model": str(engine.models.ckpt.path), "prediction_type": None,
                                     "text_encoder": None, "turbo": False, "prompt": "a cat", "lora": [],
                                     "steps": None, "cfg": None, "sampler": None, "timestep_spacing": None, **kw})

    tagged = args(prompt=f"a cat <lora:{LIGHTNING_8}:1>")
    _resolve_turbo_defaults(tagged)
    assert (tagged.steps, tagged.cfg, tagged.sampler) == (8, 1.0, "euler")
    given = args(lora=[f"{path}:1"], steps=12)
    _resolve_turbo_defaults(given)
    assert (given.steps, given.cfg) == (12, 1.0)
