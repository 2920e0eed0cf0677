"""torch.compile of the UNet (sdlite.engine.compile), on tiny models: the shipped demo model, and for the compile
itself the demo with its UNet swapped for a one-level one (32 channels, one ResBlock and one transformer per block:
half the demo's kernels, so half its compile time).

* Compiled equals eager, LoRA included, and Inductor's on-disk cache serves a second process: two fresh Python
  processes share one ``SDLITE_CACHE_DIR`` (a tmp folder); the first compiles (FX graph cache miss), the second
  finds the graph there (``fxgraph_cache_hit``, Inductor's own counter) and gets its compiled UNet faster.
* Where compiling cannot run (no C++ compiler, simulated; memory mode 0) or fails while running, the engine runs
  eager with one line on stderr, never an error.

Tolerance of compiled against eager: the latents after 3 Euler steps in fp32 (``exact``), relative to their largest
magnitude (about 9). Inductor fuses the GroupNorm statistics, pointwise chains and residual adds into C++ loops that
sum in another order than ATen's kernels, and the compiled UNet has plain weights where eager's are prepacked for
oneDNN on AVX-512 CPUs (another summation order again); the convolutions, matmuls and attention are oneDNN / ATen
calls either way. Reordered fp32 sums differ by a few ulp per layer: measured 5e-7 relative here (4.3e-6 absolute),
3.7e-6 relative with the demo's three-level UNet. The bound, 1e-4 relative, is 27 times the larger, and 550 times
smaller than what the test's LoRA changes (5.5e-2 relative).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sdlite.cli import build_parser, demo_model_path
from sdlite.engine import compile as compile_module
from sdlite.pipeline import Engine, Request

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4

# One process of the cache test: the demo model with and without compiling, a LoRA merged and removed; prints JSON.
PROCESS = r"""
import json, sys, time
import torch
torch.set_num_threads(1)
from safetensors.torch import save_file
from torch._dynamo.utils import counters
from sdlite.adapters import lora as L
from sdlite.engine.compile import Compiled
from sdlite.pipeline import Engine, Request

lora_path, demo = sys.argv[1], sys.argv[2]
r = Request(prompt="a red circle on a blue background", width=64, height=64, steps=3, seed=7, sampler="euler")
compiled = Engine.load(demo, precision="exact", compile=True)
t0 = time.perf_counter()
base = compiled.generate(r).latents
first = time.perf_counter() - t0
eager = Engine.load(demo, precision="exact")
# a LoRA of every attention projection of the UNet (kohya names), random factors
g = torch.Generator().manual_seed(5)
state = {}
unet = eager.models.get("unet")
for name, layer in unet.named_modules():
    if name.endswith((".to_q", ".to_k", ".to_v", ".to_out.0")):     # Linear, or prepacked (PackedLinear)
        key = "lora_unet_" + name.replace(".", "_")
        state[key + ".lora_down.weight"] = torch.randn(4, layer.in_features, generator=g) / layer.in_features ** 0.5
        state[key + ".lora_up.weight"] = torch.randn(layer.out_features, 4, generator=g) * 0.2
save_file(state, lora_path)

def run(engine, lora):
    if not lora:
        return engine.generate(r).latents
    with L.engine_with_loras(engine, [(lora_path, 1.0)]):
        return engine.generate(r).latents

out = {"first": first, "layers": len(state) // 2}
ref, ref_lora = run(eager, False), run(eager, True)
with_lora, after = run(compiled, True), run(compiled, False)
runner = compiled.models.runner("unet", compiled.models.get("unet"))
out.update(
    compiled=isinstance(runner, Compiled), failed=getattr(runner, "failed", None),
    scale=ref.abs().max().item(), diff=(base - ref).abs().max().item(),
    lora_diff=(with_lora - ref_lora).abs().max().item(),
    lora_change=(with_lora - base).abs().max().item(), after_diff=(after - ref).abs().max().item(),
    graphs=counters["stats"]["unique_graphs"], hits=counters["inductor"]["fxgraph_cache_hit"],
    misses=counters["inductor"]["fxgraph_cache_miss"])
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    """The demo model with a one-level UNet (random weights, as tests/reference.py seeds them)."""
    from sdlite.config import UNetConfig
    from sdlite.export import save_diffusers
    from sdlite.loader import StableDiffusion, open_model
    from sdlite.models.unet import UNet
    from tests.reference import seed_all

    ckpt = open_model(demo_model_path())
    cfg = UNetConfig(block_channels=(32,), layers_per_block=1, attention=(True,), heads=(2,),
                     context_dim=ckpt.spec.unet.context_dim, norm_groups=8, sample_size=8)
    model = StableDiffusion(spec=ckpt.spec.replace(unet=cfg), tokenizer=ckpt.tokenizer(),
                            text_encoder=ckpt.load("text_encoder"), unet=seed_all(UNet(cfg), 1, scale=0.1),
                            vae=ckpt.load("vae"), scheduler_config=dict(ckpt.scheduler_config))
    return save_diffusers(model, tmp_path_factory.mktemp("compile") / "tiny")


def run_process(cache: Path, lora: Path, folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHINDUCTOR_CACHE_DIR"}
    env.update(SDLITE_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", PROCESS, str(lora), str(folder)], env=env, capture_output=True, text=True,
                          cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "sdlite: --compile:" not in done.stderr, done.stderr   # it compiled: no fallback line
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(compile_module.unavailable() is not None, reason="no C++ compiler for Inductor here")
def test_compiled_equals_eager_and_the_cache_serves_the_next_process(tmp_path, tiny_folder):
    cache = tmp_path / "cache"
    cold = run_process(cache, tmp_path / "lora.safetensors", tiny_folder)
    assert cold["compiled"] and cold["failed"] is None
    assert cold["misses"] >= 1 and cold["hits"] == 0
    bound = TOLERANCE * cold["scale"]
    assert cold["diff"] < bound, cold
    # a LoRA merged into the weights changes the compiled model's output as it changes eager's (the graph reads the
    # weights as inputs: nothing frozen), with no recompile; removed, the output is the base one again
    assert cold["layers"] > 10 and cold["lora_change"] > 100 * bound
    assert cold["lora_diff"] < bound and cold["after_diff"] < bound
    assert cold["graphs"] == 1
    assert any((cache / "inductor" / "fxgraph").rglob("*")), "Inductor's graphs are in the user's cache folder"

    warm = run_process(cache, tmp_path / "lora.safetensors", tiny_folder)
    assert warm["hits"] >= 1 and warm["misses"] == 0, warm
    assert warm["diff"] < bound and warm["lora_diff"] < bound
    print(f"first compiled generation: {cold['first']:.1f} s cold, {warm['first']:.1f} s from the cache")
    assert warm["first"] < cold["first"]


# --- eager fallbacks (in this process; nothing is compiled) ----------------------------------------------------

REQUEST = Request(prompt="a red circle", width=64, height=64, steps=2, seed=3, sampler="euler")


@pytest.fixture
def fresh_notices(monkeypatch):
    import sdlite.errors

    monkeypatch.setattr(sdlite.errors, "_noticed", set())


def notices(captured: str) -> list[str]:
    return [line for line in captured.splitlines() if line.startswith(compile_module.PREFIX)]


@pytest.fixture(scope="module")
def eager_latents():
    torch.manual_seed(0)
    return Engine.load(demo_model_path(), precision="exact").generate(REQUEST).latents


def test_no_compiler_runs_eager_with_one_line(monkeypatch, capsys, fresh_notices, eager_latents):
    monkeypatch.setattr(compile_module, "compiler_problem", lambda: "no C++ compiler (g++) found")
    engine = Engine.load(demo_model_path(), precision="exact", compile=True)
    first = engine.generate(REQUEST).latents
    second = engine.generate(REQUEST).latents
    lines = notices(capsys.readouterr().err)
    assert lines == ["sdlite: --compile: no C++ compiler (g++) found; running eager"]
    assert torch.equal(first, eager_latents) and torch.equal(second, eager_latents)
    assert engine.models.runner("unet", engine.models.get("unet")) is engine.models.get("unet")


def test_compiler_check_names_the_missing_compiler(monkeypatch):
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config.cpp, "cxx", (None, "sdlite-no-such-compiler++"))
    assert compile_module.compiler_problem.__wrapped__() == "no C++ compiler (sdlite-no-such-compiler++) found"


def test_memory_mode_0_runs_eager_with_one_line(capsys, fresh_notices, eager_latents):
    engine = Engine.load(demo_model_path(), precision="exact", compile=True, memory_mode=0)
    latents = engine.generate(REQUEST).latents
    lines = notices(capsys.readouterr().err)
    assert len(lines) == 1 and "memory mode 0" in lines[0] and lines[0].endswith("; running eager")
    assert (latents - eager_latents).abs().max() < TOLERANCE * eager_latents.abs().max()


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 4)

    def forward(self, x):
        if x.shape[-1] != 4:
            raise ValueError("expected 4 features")
        return self.layer(x)


def test_a_failure_while_compiling_runs_eager_with_one_line(capsys, fresh_notices):
    net = _Tiny()
    runner = compile_module.Compiled(net, "unet")

    def broken(*args, **kwargs):
        raise RuntimeError("C++ compile failed: g++ exited with 1\nlong compiler output")

    runner._fn = broken
    x = torch.randn(2, 4)
    assert torch.equal(runner(x), net(x)) and torch.equal(runner(x), net(x))
    assert runner.failed == "RuntimeError: C++ compile failed: g++ exited with 1"
    assert notices(capsys.readouterr().err) == [
        "sdlite: --compile: compiling the unet failed (RuntimeError: C++ compile failed: g++ exited with 1); "
        "running eager"]


def test_the_callers_own_error_is_raised_and_compiling_stays_on(fresh_notices, capsys):
    runner = compile_module.Compiled(_Tiny(), "unet")
    runner._fn = runner.module.forward    # stands in for the compiled function: the same error eager raises
    with pytest.raises(ValueError, match="expected 4 features"):
        runner(torch.randn(2, 3))
    assert runner.failed is None and notices(capsys.readouterr().err) == []


def test_inductor_cache_folder(tmp_path):
    assert compile_module.inductor_cache_dir({"SDLITE_CACHE_DIR": str(tmp_path)}) == tmp_path / "inductor"
    assert compile_module.inductor_cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "sdlite" / "inductor"
    assert compile_module.inductor_cache_dir({"SDLITE_CACHE_DIR": str(tmp_path),
                                              "TORCHINDUCTOR_CACHE_DIR": "/elsewhere"}) == Path("/elsewhere")
    # the default Inductor writes into the variable when it first looks is not the user's choice
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    assert compile_module.inductor_cache_dir({"SDLITE_CACHE_DIR": str(tmp_path),
                                              "TORCHINDUCTOR_CACHE_DIR": default_cache_dir()}) == tmp_path / "inductor"


def test_cli_options():
    parser = build_parser()
    for command in (["generate", "x"], ["serve"], ["batch", "jobs.jsonl", "-o", "out"]):
        assert parser.parse_args(command).compile is False      # opt-in everywhere (figures in engine/compile.py)
        assert parser.parse_args(command + ["--compile"]).compile is True
    with pytest.raises(ValueError, match="compile 'sometimes' is not valid"):
        Engine.load(demo_model_path(), precision="exact", compile="sometimes")
