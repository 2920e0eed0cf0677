"""The precision policy: which number formats each network computes in, chosen per device and CPU.

One table, read by the engine (what to load), ``sdlite info --system`` (what ``auto`` chose here and why), the PNG
parameters (``Precision: ...``, the precision actually used) and the server (``--precision``), in the spirit of
OpenVINO's PERFORMANCE / ACCURACY execution modes:

* ``exact`` -- fp32 everywhere: the path that matches diffusers (every parity test names it). Prepacked weights
  and Winograd convolutions apply where this CPU gains from them; they reorder sums, they round nothing.
* ``fp32-fast`` -- fp32 everywhere, as ``exact``, channels-last, with the UNet's and VAE's attention and GEGLU on
  sdlite's fused fp32 kernels for AVX2 (:mod:`sdlite.kernels.fp32`) and their 3x3 convolutions on maps from 32x32
  by Winograd's F(4x4, 3x3) with sdlite's transforms (:mod:`sdlite.engine.winograd`; 2.25x fewer products than
  exact's F(2x2, 3x3)): they sum in another order, compute exp and erf by their own polynomials and round the
  filter transform's 1/6, 1/12 and 1/24, so the image differs from ``exact``'s by about fp32 rounding
  (BENCHMARKS.md gives its PSNR). Needs AVX2 and FMA, and a C++ compiler to build the kernels (without one it runs
  PyTorch's operations and F(2x2, 3x3)).
* ``bf16`` -- the UNet and the VAE in bf16, channels-last, end to end (norms, attention -- sdlite's fused kernel
  on AVX512-BF16 CPUs (:mod:`sdlite.kernels.bf16`, ~3x PyTorch's flash kernel there), else PyTorch's -- and
  activations too, no fp32 round trips between layers), and the text encoders in bf16 too: SD 1.5's CLIP ViT-L
  encodes a prompt in 0.027 s against 0.097 s in fp32 (a 2-core AMD EPYC with AVX512-BF16), a third of a one-step
  image's fixed cost, and the images did not move (bf16-int8 against exact, 3 seeds at 512x512, 8 steps, CFG 7.5:
  45.6-45.7 dB with the text encoder in bf16, 45.5-45.8 dB in fp32). T5-XXL (SD3) computes in bf16, as it was
  trained: 4.7B parameters, 19 GB in fp32 against 9.5 GB, and the larger part of an SD3 generation's text encoding (one
  full-size layer on a CFG batch of 256 tokens: 1.38 s against 3.26 s in fp32 on a busy 2-core Xeon with AMX, its
  output 2e-2 from fp32's, relative; BENCHMARKS.md, "SD3.5", gives the image's distance from exact). Needs native bf16 dot products to pay: ``avx512_bf16``,
  ``amx_bf16`` or ``avx_ne_convert``; with AVX-512 but none of them oneDNN emulates bf16 (2.5-3x slower than fp32,
  allowed with a warning); below AVX-512 it is refused. On the CPU the VAE's and a TAESD's upsamplers run by phases
  (:mod:`sdlite.engine.subpixel`: 16 products per small pixel instead of 36).
* ``bf16-int8`` -- ``bf16``, with the UNet's 3x3 convolutions (ResNet blocks, down/upsamplers) and its transformers'
  Linear layers (but the cross-attention's key and value, on 77 text tokens) in int8: weights per output channel,
  activations 8-bit per tensor, scaled per call by sdlite's range and code kernels (:mod:`sdlite.kernels.bf16`), bf16 in and out, so the
  activations stay bf16 and channels-last between layers. oneDNN's u8 x s8 convolutions run at ~2000 GOP/s on the
  UNet's 320-640 channel shapes here, against ~1050 GFLOP/s for bf16, which already runs at this CPU's peak. Needs
  native bf16 and VNNI or AMX (exact 8-bit products). On a transformer (FLUX.1, SD3, Z-Image, FLUX.2 [klein],
  Qwen-Image) the same layers are the Linear layers of its blocks (:func:`sdlite.engine.quant.transformer_int8_targets`:
  attention projections and MLPs; not the per-block modulation Linears), quantised as the file loads (a GGUF file's
  blocks dequantised first): W8A8 on oneDNN's u8 x s8 GEMM, the activations scaled per token
  (:func:`sdlite.engine.quant.quantize_rows`). T5 (SD3's and FLUX.1's, loaded whole from a dense file) takes the same
  on its blocks' Linears, with an input's outlier columns computed apart in float (LLM.int8()'s decomposition:
  :func:`sdlite.engine.quant.outlier_columns`); CLIP and the LLM encoders (Qwen) stay bf16. Memory mode 0 is refused with it, as for a UNet. ``auto``'s choice for a
  transformer too (below): docs/precision.md gives its speed and its error against exact beside diffusers' own bf16's,
  measured on random weights, which lack the outlier channels trained transformers have.
* ``int8`` / ``int8-bf16`` -- the UNet's Linear and Conv2d layers in int8 (:mod:`sdlite.engine.quant`), the rest
  as in ``exact``.
* ``int8`` / ``int4`` for a transformer (FLUX.1, SD3/SD3.5) -- weight-only: the Linear weights of its blocks
  quantised as the file loads and kept so in memory (int8: one scale per output channel; int4: groups of 64 values
  with an fp16 scale and minimum), dequantised layer by layer as they run (:mod:`sdlite.engine.lowbit`, as GGUF
  weights are); T5's in int8 under both. Activations in bf16 on CPUs with native bf16 (as ``bf16``), else fp32.
  Torch's int8 / int4 weight-only matmuls are 10-30x slower on this CPU than dequantising and calling bf16
  ``F.linear`` (BENCHMARKS.md gives the numbers and the images' PSNR against ``exact``). Memory mode 0 (streaming the
  blocks from the file) is refused with them: they hold the quantised network in memory instead.
* ``fp16`` -- half precision compute on a GPU (CUDA, MPS), as diffusers runs there; the SDXL VAE in fp32.
* ``auto`` (the default) -- the fastest of these that meets the quality bound (PSNR >= 40 dB against ``exact`` on
  the full-size SD 1.5, >= 35 dB on the demo model; BENCHMARKS.md) on this device: ``fp16`` on a GPU;
  ``bf16-int8`` on a CPU with native bf16, VNNI (or AMX) and sdlite's AVX512-BF16 kernels, for UNets and
  transformers alike (``bf16`` for the SD x4 upscaler, whose int8 quality is not measured; where memory mode 0 streams
  the denoiser, or fp8 storage keeps a transformer's weights, which int8 layers cannot be; and for a GGUF transformer,
  whose blocks stay as the file holds them); ``bf16`` on other CPUs with native bf16; ``fp32-fast`` on CPUs without native bf16 that run sdlite's AVX2
  kernels; ``exact`` on any other CPU, and for small UNets (under 128 channels at the first level, the demo's 32),
  where bf16 is slower than fp32 (a 20-step demo image: 0.21 s against 0.16 s) and the fp32 kernels gain nothing
  (the demo's attention is under their size threshold).

Why ``auto`` takes bf16-int8 and never int8 (``python bench/precision.py all``: SD 1.5 UNet, 512x512, batch 2, each
precision in its own process, 2-core Zen 4 with AVX512-VNNI and AVX512-BF16): one step takes 5.50 s in exact
(prepacked fp32, Winograd), 2.22 s in bf16 (with sdlite's bf16 kernels), 1.50 s in bf16-int8 and 3.04 s in int8; the
step's output is at 40.2 dB (bf16), 33.0 dB (bf16-int8) and 30.8 dB (int8) against exact. The images are what the
bound is about: bf16-int8's lowest PSNR of 8 seeds against exact is 47.9 dB (SD 1.5, 256x256) and 48.1 dB (SDXL).
int8 keeps fp32 between its layers and in the decoder, so it is slower than both. Without VNNI int8 activations
use 7 bits (twice as coarse, about 6 dB lower again): such a CPU gets ``exact``, which is never slower than before
this policy existed.

Whole generations (``bench/openvino.py``, 512x512, 20 steps, medians of 3): exact 116.5 s, bf16-int8 35.4 s, against
OpenVINO's default 45.3 s on the same machine (0.78x); the bf16-int8 image is at 48.0 dB against exact's.
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import torch

from ..errors import SDLiteError
from ..machine import BF16_FLAGS, CPUInfo, this_cpu
from .cpu import bf16_int8_problem, bf16_support
from .lowbit import FP8_MODES
from .quant import BF16Warning, check_quantize_mode

PRECISIONS = {
    "auto": "the fastest path meeting the quality bound on this device (see `sdlite info --system`)",
    "exact": "fp32 everywhere: the diffusers-exact path",
    "fp32-fast": "fp32 everywhere, attention, GEGLU and Winograd F(4x4,3x3) convolutions on sdlite's AVX2 kernels "
                 "(not bit-exact: about fp32 rounding)",
    "bf16": "UNet (or transformer) and VAE in bf16, channels-last end to end; CLIP fp32, T5 bf16 (needs native bf16 "
            "on a CPU)",
    "int8": "UNet Linear/Conv2d in int8 (weights per channel, activations dynamic), the rest fp32; a transformer's "
            "(FLUX, SD3) Linear weights and T5's in int8 per output channel, dequantised per layer (bf16 compute on "
            "native-bf16 CPUs, else fp32)",
    "int4": "a transformer's (FLUX, SD3) Linear weights in 4 bits (groups of 64, fp16 scale and minimum), T5's in "
            "int8, dequantised per layer; compute as int8's (not for UNets)",
    "int8-bf16": "UNet Linear in int8, its convolutions in bf16, the rest fp32",
    "bf16-int8": "bf16 (as bf16) with the UNet's 3x3 convolutions and transformer Linear layers in int8; a DiT's "
                 "(FLUX, SD3, Z-Image, klein, Qwen-Image) block Linears and T5's in int8 (W8A8, 8-bit activations "
                 "per token; T5's outlier columns in float; see docs/precision.md) (needs native bf16 and VNNI/AMX "
                 "on a CPU)",
    "fp16": "fp16 compute on a GPU (the SDXL VAE in fp32)",
}
PRECISION_CHOICES = tuple(PRECISIONS)
# why auto takes bf16-int8 (bench/precision.py, bench/openvino.py; BENCHMARKS.md)
BF16_INT8_WHY = ("native bf16 dot products and VNNI (8-bit int8 products), and sdlite's AVX512-BF16 kernels: bf16 "
                 "with the UNet's heaviest layers in int8 (a 512x512 SD 1.5 image: 35.4 s against exact's 116.5 s, "
                 "OpenVINO's default 45.3 s) at >= 40 dB against exact (48.0 dB)")
# ... and for a transformer's blocks (bench/dit.py, bench/dit_quality.py; BENCHMARKS.md "DiT families")
BF16_INT8_DIT_WHY = ("native bf16 dot products and VNNI (8-bit int8 products), and sdlite's AVX512-BF16 kernels: bf16 "
                     "with the Linear layers of the transformer's blocks in int8, activations scaled per token (the "
                     "step at 512x512 0.51x diffusers' bf16 for FLUX.1-schnell and SD3.5 Medium), as close to exact as "
                     "diffusers' own bf16 is (random weights, 4 steps: FLUX.1 50.3 dB against diffusers bf16's 50.1, "
                     "SD3.5 50.3 dB against 50.2)")
# why auto takes fp32-fast where there is no native bf16 (bench/precision.py, bench/openvino.py under the AVX2 cap)
FP32_FAST_WHY = ("no native bf16, and sdlite's fp32 kernels for AVX2 run here: fp32 with attention and GEGLU "
                 "fused and 3x3 convolutions by Winograd F(4x4,3x3) (faster than exact, within about fp32 rounding "
                 "of it); bf16 would have no fast kernels and int8 falls below the quality bound")
# auto keeps a UNet narrower than this at its first level (the demo's: 32) in fp32, where bf16 does not pay;
# every Stable Diffusion family has 320
MIN_BF16_CHANNELS = 128
# names accepted for the ones above
ALIASES = {"fp32": "exact", "float32": "exact", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}


class PrecisionError(SDLiteError, ValueError):
    """A precision that is not valid, or that this device cannot run (the message says which and why)."""


@dataclass(frozen=True)
class Precision:
    """What a precision means for each network of one engine."""
    name: str                     # the precision used: exact, bf16, int8, int8-bf16, fp16
    requested: str                # what was asked for (auto, or the same as name)
    dtype: torch.dtype            # the UNet's compute dtype
    vae_dtype: torch.dtype        # the VAE's
    text_dtype: torch.dtype       # the text encoders'
    quantize: str = "none"        # sdlite.engine.quant's mode for the UNet (bf16-int8: or the transformer)
    channels_last: bool = False   # UNet and VAE weights (and so their activations) channels-last
    reason: str = ""              # why (for auto: why this one on this device)
    fp32_kernels: bool = False    # attention and GEGLU on sdlite's fp32 kernels (fp32-fast)
    t5_dtype: torch.dtype | None = None   # T5's, where it is not text_dtype (None: text_dtype)
    lowbit: str = "none"          # a transformer's Linear weights kept in int8 / int4 / fp8 (sdlite.engine.lowbit)

    @property
    def label(self) -> str:
        """The PNG parameters' ``Precision`` value: the precision used, and ``auto`` when it was chosen."""
        return f"{self.name} (auto)" if self.requested == "auto" and self.name != "auto" else self.name


def check_precision(name) -> str:
    """The canonical name of ``name`` (aliases resolved), or a :class:`PrecisionError` listing the choices."""
    if isinstance(name, str):
        key = name.strip().lower()
        key = ALIASES.get(key, key)
        if key in PRECISIONS:
            return key
    listed = "; ".join(f"{k}: {v}" for k, v in PRECISIONS.items())
    raise PrecisionError(f"precision {name!r} is not valid: expected one of {', '.join(PRECISION_CHOICES)} "
                         f"({listed})")


def auto_choice(device: str | torch.device = "cpu", cpu: CPUInfo | None = None, spec=None) -> tuple[str, str]:
    """(precision, why) that ``auto`` takes on ``device`` (on a CPU: this CPU, as its effective flags say) for a
    model of ``spec`` (a :class:`~sdlite.config.ModelSpec`; None: a full-size one)."""
    device = torch.device(device)
    if device.type != "cpu":
        return "fp16", f"a {device.type} device: fp16 compute, as diffusers runs there"
    here = cpu is None or cpu is this_cpu()
    cpu = cpu or this_cpu()
    small = spec is not None and spec.unet is not None and spec.unet.block_channels[0] < MIN_BF16_CHANNELS
    if cpu.native_bf16 and small:
        return "exact", (f"a small UNet ({spec.unet.block_channels[0]} channels at its first level, under "
                         f"{MIN_BF16_CHANNELS}): bf16's conversions cost more than its kernels save (the demo: "
                         "0.21 s a 20-step image in bf16, 0.16 s in fp32)")
    transformer = spec is not None and spec.unet is None
    if bf16_int8_problem(None if here else cpu) is None and not (spec is not None and spec.is_x4_upscaler) \
            and _kernels_run(cpu, here):
        return "bf16-int8", (BF16_INT8_DIT_WHY if transformer else BF16_INT8_WHY)
    if cpu.native_bf16:
        flags = ", ".join(f for f in BF16_FLAGS if cpu.has(f))
        return "bf16", (f"native bf16 dot products ({flags}): the UNet and VAE in bf16 run about 2.4x faster than "
                        "fp32 (a 512x512 SD 1.5 image: 47-50 s against 116.5 s; 1.6x without sdlite's bf16 kernels) "
                        "at >= 40 dB against it")
    if not small and _fp32_kernels_run(cpu, here):
        return "fp32-fast", FP32_FAST_WHY
    if cpu.avx512:
        return "exact", ("AVX-512 without native bf16: bf16 would be emulated (2.5-3x slower than fp32) and int8 "
                         "falls below the quality bound; fp32")
    return "exact", ("no native bf16 (oneDNN ISA " + cpu.isa_level + "): bf16 has no fast kernels here and "
                     "int8 (7-bit activations without VNNI) falls below the quality bound; fp32")


STREAMED_WHY = "the denoiser is streamed block by block (memory mode 0), which int8 layers cannot be"


def whole_unet(plan: Precision, streams: bool, why: str = STREAMED_WHY) -> Precision:
    """``plan`` for an engine whose denoiser (UNet or transformer) cannot hold int8 layers when ``streams`` (``why``
    says why: streamed block by block in memory mode 0, weights kept in another dtype or as a GGUF file's blocks):
    int8 layers need it loaded whole, so an ``auto`` that chose ``bf16-int8`` takes ``bf16`` there (an int8
    precision asked for by name is refused by the engine, saying why)."""
    if not streams or plan.requested != "auto" or plan.name != "bf16-int8":
        return plan
    return Precision("bf16", "auto", plan.dtype, plan.vae_dtype, plan.text_dtype, channels_last=plan.channels_last,
                     t5_dtype=torch.bfloat16, reason=f"{why}: bf16; " + plan.reason)


def _kernels_run(cpu: CPUInfo, here: bool) -> bool:
    """Whether sdlite's AVX512-BF16 kernels run on ``cpu`` (on this machine: also built and loaded; bf16-int8
    quantizes its activations with them, PyTorch's six passes would cost more than int8 saves)."""
    from ..kernels import bf16 as kernels

    if kernels.cpu_problem(cpu) is not None:
        return False
    return kernels.available() if here else True


def _fp32_kernels_run(cpu: CPUInfo, here: bool) -> bool:
    """Whether sdlite's AVX2 fp32 kernels run on ``cpu`` (on this machine: also built and loaded)."""
    from ..kernels import fp32 as kernels

    if kernels.cpu_problem(cpu) is not None:
        return False
    return kernels.available() if here else True


def resolve(name: str = "auto", device: str | torch.device = "cpu", cpu: CPUInfo | None = None,
            spec=None) -> Precision:
    """What precision ``name`` means on ``device`` for a model of ``spec`` (None: full size): ``auto`` resolved; a
    CPU that cannot run it usefully refused."""
    requested = check_precision(name)
    device = torch.device(device)
    chosen, reason = auto_choice(device, cpu, spec) if requested == "auto" else (requested, "asked for")
    fp32, bf16 = torch.float32, torch.bfloat16
    if chosen == "fp16":
        if device.type == "cpu":
            raise PrecisionError("precision 'fp16' is for GPUs: PyTorch's CPU kernels compute fp16 slowly or not "
                                 "at all; use bf16 (native bf16 CPUs), int8 or exact on a CPU")
        return Precision("fp16", requested, torch.float16, torch.float16, torch.float16, reason=reason)
    if chosen == "exact":
        return Precision("exact", requested, fp32, fp32, fp32, reason=reason)
    if chosen == "fp32-fast":
        if device.type != "cpu":
            raise PrecisionError(f"precision 'fp32-fast' runs sdlite's AVX2 CPU kernels; on {device.type} use fp16 "
                                 "or exact")
        from ..kernels import fp32 as kernels

        problem = kernels.cpu_problem(cpu)
        if problem:
            raise PrecisionError(f"precision 'fp32-fast' needs a CPU with AVX2 and FMA: {problem}; use exact")
        return Precision("fp32-fast", requested, fp32, fp32, fp32, channels_last=True, reason=reason, fp32_kernels=True)
    if chosen == "bf16":
        if device.type == "cpu":
            _check_bf16(cpu)
        return Precision("bf16", requested, bf16, bf16, bf16, channels_last=device.type == "cpu", reason=reason,
                         t5_dtype=bf16)
    transformer = spec is not None and spec.unet is None
    if chosen == "int4" or (chosen == "int8" and transformer):
        return _weight_only(chosen, requested, device, cpu, spec, reason)
    # int8 modes: the CPU's oneDNN kernels
    if transformer and chosen != "bf16-int8":
        raise PrecisionError(f"precision {chosen!r} quantizes a UNet's layers; this model's transformer "
                             f"({spec.family}) has int8 compute on its blocks (--precision bf16-int8), weight-only "
                             "int8 and int4 (--precision int8 / int4), or bf16 and exact")
    if device.type != "cpu":
        raise PrecisionError(f"precision {chosen!r} runs on oneDNN's CPU kernels; on {device.type} use fp16 or exact")
    if chosen == "bf16-int8":
        _check_bf16_int8(cpu)
        return Precision("bf16-int8", requested, bf16, bf16, bf16, quantize="bf16-int8", channels_last=True,
                         reason=reason, t5_dtype=bf16)
    if chosen == "int8-bf16":
        _check_bf16(cpu)
    return Precision(chosen, requested, fp32, fp32, fp32, quantize=chosen, reason=reason)


def _weight_only(name: str, requested: str, device: torch.device, cpu: CPUInfo | None, spec,
                 reason: str) -> Precision:
    """int8 / int4 for a transformer (FLUX, SD3): its blocks' Linear weights (and T5's, in int8) quantised at load
    and dequantised layer by layer (:mod:`sdlite.engine.lowbit`); activations in bf16 where the CPU has native bf16
    dot products (as the bf16 precision), else fp32. ``spec`` None (no model yet): the plan a transformer gets."""
    if spec is not None and spec.unet is not None:
        raise PrecisionError(f"precision {name!r} is weight-only low-bit storage for a transformer (FLUX, SD3); this "
                             f"model ({spec.family}) has a UNet: use int8, bf16-int8 or bf16")
    if device.type != "cpu":
        raise PrecisionError(f"precision {name!r} for a transformer dequantises its weights on the CPU here; on "
                             f"{device.type} use fp16 or exact (a GGUF file keeps its low-bit weights on any device)")
    if bf16_support(cpu) == "native":
        bf16 = torch.bfloat16
        return Precision(name, requested, bf16, bf16, torch.float32, channels_last=True, t5_dtype=bf16,
                         lowbit=name, reason=reason)
    fp32 = torch.float32
    return Precision(name, requested, fp32, fp32, fp32, lowbit=name, reason=reason)


#: the weight storages of a transformer an engine takes beside its precision (ComfyUI's UNETLoader weight_dtype)
WEIGHT_STORAGES = ("default", *FP8_MODES)


def stored_as(plan: Precision, storage: str, spec=None) -> Precision:
    """``plan`` with a transformer's Linear weights kept as ``storage`` says: ``default`` as the plan keeps them,
    ``fp8_e4m3fn`` / ``fp8_e5m2`` cast to that fp8 type and converted into the plan's compute dtype layer by layer as
    they run (:mod:`sdlite.engine.lowbit`). A UNet model (``spec``; None: not known yet) and a precision that already
    stores them low-bit (int8, int4) are refused, saying why."""
    if storage == "default":
        return plan
    if storage not in FP8_MODES:
        raise PrecisionError(f"weight storage {storage!r} is not valid: expected one of {', '.join(WEIGHT_STORAGES)}")
    if spec is not None and spec.unet is not None:
        raise PrecisionError(f"weight storage {storage!r} keeps a transformer's (FLUX, SD3) Linear weights in fp8; "
                             f"this model ({spec.family}) has a UNet, whose weights sdlite keeps in its precision")
    # auto's bf16-int8 gives way to fp8 storage (Engine.load: whole_unet), as to streaming
    if plan.lowbit != "none" or (plan.quantize != "none" and plan.requested != "auto"):
        raise PrecisionError(f"weight storage {storage!r} and precision {plan.name!r} both say how the transformer's "
                             "weights are stored: ask for one (precision bf16 or exact with fp8 storage)")
    return dataclasses.replace(plan, lowbit=storage)


def _check_bf16_int8(cpu: CPUInfo | None) -> None:
    problem = bf16_int8_problem(cpu)
    if problem:
        raise PrecisionError(f"precision 'bf16-int8' {problem} (or auto)")


def _check_bf16(cpu: CPUInfo | None) -> None:
    support = bf16_support(cpu)
    if support == "emulated":
        warnings.warn("this CPU has no native bf16 (avx512_bf16, amx_bf16): oneDNN emulates it with AVX-512, "
                      "2.5-3x slower than fp32 (--precision auto picks fp32 here)", BF16Warning, stacklevel=3)
    if support == "none":
        cpu = cpu or this_cpu()
        capped = f" under ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap else ""
        raise PrecisionError(
            f"bf16 needs bf16 kernels, and this CPU{capped} has neither native bf16 (avx512_bf16, amx_bf16, "
            f"avx_ne_convert) nor AVX-512 to emulate it (oneDNN ISA {cpu.isa_level}): oneDNN falls back to a "
            "reference kernel, 6-120x slower than fp32. Use --precision exact (or auto), or int8")


def from_legacy(dtype: torch.dtype | None, quantize: str | None = "none") -> str | None:
    """The precision the older ``dtype`` / ``quantize`` options ask for (None: neither was given).

    ``quantize="bf16"`` (bf16 Linear and Conv2d layers, fp32 between them) becomes the ``bf16`` precision, which
    is the same arithmetic in the layers and faster (no fp32 round trips); ``dtype=bfloat16`` too."""
    if quantize not in (None, "none"):
        check_quantize_mode(quantize)
        return quantize
    if dtype is None:
        return None
    named = {torch.float32: "exact", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in named:
        raise PrecisionError(f"dtype {dtype} is not valid: expected float32, bfloat16 or float16")
    return named[dtype]


def choose_precision(precision: str | None, dtype: torch.dtype | None = None, quantize: str | None = "none",
                     device: str | torch.device = "cpu", cpu: CPUInfo | None = None, spec=None) -> Precision:
    """:func:`resolve` for the engine's options: ``precision`` (None: ``auto``), or the older ``dtype`` /
    ``quantize``, which must agree with it when both are given."""
    legacy = from_legacy(dtype, quantize)
    if precision is None:
        return resolve(legacy or "auto", device, cpu, spec)
    name = check_precision(precision)
    if legacy is not None and legacy != name:
        raise PrecisionError(f"precision {precision!r} and the older dtype/quantize options (dtype {dtype}, quantize "
                             f"{quantize!r}, which mean {legacy!r}) disagree: give only --precision")
    return resolve(name, device, cpu, spec)


def precision_report(cpu: CPUInfo | None = None) -> list[str]:
    """The lines ``sdlite info --system`` adds: what ``auto`` picks on this CPU and why, and which precisions run."""
    cpu = cpu or this_cpu()
    chosen, why = auto_choice("cpu", cpu)
    lines = [f"precision:   auto -> {chosen} on this CPU: {why}"]
    if chosen in ("bf16", "bf16-int8"):
        lines.append(f"             (exact for small models such as the demo: {chosen} does not pay there)")
    if bf16_support(cpu) == "native":
        from ..kernels import bf16 as kernels
        lines.append(f"  bf16 attention and GEGLU: {kernels.status()}")
    if chosen == "fp32-fast":
        from ..kernels import fp32 as fp32_kernels
        lines.append(f"  fp32-fast attention and GEGLU: {fp32_kernels.status()}")
    from ..kernels import dequant
    lines.append(f"  GGUF / int8 / int4 weights decoded by: {dequant.status()}")
    for name, what in PRECISIONS.items():
        if name == "auto":
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", BF16Warning)
                resolve(name, "cpu", cpu)
            runs = "emulated bf16: slower than fp32" if "bf16" in name and bf16_support(cpu) == "emulated" else "runs"
        except PrecisionError as e:
            runs = f"refused here: --precision {name} says why"
        lines.append(f"  {name:<11}{what} [{runs}]")
    return lines
