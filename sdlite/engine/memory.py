"""Memory modes, as MNN defines them, and weight streaming.

* mode 1 -- all resident: text encoder, UNet and VAE are loaded once and kept (fastest).
* mode 2 -- balanced: the UNet stays resident; the text encoder and the VAE are loaded when needed and freed.
* mode 0 -- low memory: every sub-model is loaded when needed and freed after; the UNet is never loaded whole:
  its weights are streamed from the memory-mapped checkpoint block by block (each ResBlock, transformer,
  resampler ...), converted to the compute dtype for that block's forward pass and dropped right after, with the
  file pages handed back to the kernel, so resident memory holds one block's weights at a time.

The same streaming mechanism with the pages kept gives "weights stored in fp16/bf16, computed in fp32": the
stored weights stay resident in their storage dtype (zero-copy views of the file when it is in that dtype) and
each block is up-cast only while it runs.
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc

import torch
from torch import nn

from ..errors import SDLiteError
from ..kernels.fp32 import release_workspace as release_fp32_workspace, use_fp32_kernels
from ..loader import TEXT_ENCODERS, Checkpoint, StableDiffusion
from ..models.bert import BertEmbeddings, BertLayer
from ..models.clip import Embeddings, EncoderLayer
from ..models.layers import Downsample, ResnetBlock, Upsample
from ..models.flux import DoubleBlock, SingleBlock
from ..models.flux2 import DoubleBlock as Flux2DoubleBlock, SingleBlock as Flux2SingleBlock
from ..weights.quants import QuantizedTensor
from .lowbit import FP8_MODES, check_low_bit_mode, in_gguf, load_low_bit, load_quantized, quantized_linears
from ..models.mmdit import JointBlock
from ..config.qwen import QwenConfig
from ..config.t5 import T5Config
from ..models.t5 import T5LayerFF
from ..models.qwen import QwenDecoderLayer
from ..models.qwenimage import DoubleBlock as QwenImageBlock
from ..models.unet import TransformerBlock
from ..models.zimage import Block as ZImageBlock
from .cpu import default_prepack
from .packing import load_prepacked, prepack_available, prepack_model, release_packed, shape_pack_model, shape_packs
from .subpixel import phase_upsample_model
from .winograd import WinogradConv2d, release_workspace, winograd_available, winograd_model
from .quant import check_quantize_supported, load_bf16_int8, quantize_model

MEMORY_MODES = {
    0: "low: each sub-model loaded when needed and freed after; UNet weights streamed block by block",
    1: "all resident (fastest)",
    2: "balanced: UNet resident; text encoder and VAE loaded when needed",
}
# modules whose forward uses their weights only through calls of their own children or themselves. A spatial
# transformer is streamed one transformer block at a time (its norm and projections are units of their own): SDXL's
# deepest ones hold 10 blocks, 1.4 GB in fp32, where one block is 139 MB
# SD3's transformer one joint block at a time, T5 one feed-forward at a time (its attention's Linears are units of their
# own: block 0's relative-position table is read before that block runs); Z-Image's, FLUX.2's and Qwen-Image's
# transformers one block at a time, a Qwen text encoder one decoder layer at a time
_UNIT_TYPES = (ResnetBlock, TransformerBlock, Downsample, Upsample, Embeddings, EncoderLayer, BertEmbeddings,
               BertLayer, JointBlock, DoubleBlock, SingleBlock, T5LayerFF, ZImageBlock, QwenDecoderLayer,
               Flux2DoubleBlock, Flux2SingleBlock, QwenImageBlock)


class MemoryModeError(SDLiteError, ValueError):
    pass


def _libc():
    name = ctypes.util.find_library("c")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return lib if lib is not None and hasattr(lib, "malloc_trim") else None


_LIBC = _libc()


def channels_last(module: nn.Module) -> nn.Module:
    """``module`` with its 4-d weights and buffers (so its convolutions' outputs) channels-last, in place, as
    ``module.to(memory_format=torch.channels_last)``, except the Winograd layers' weights: their filter transform reads
    the plain (out, in, 3, 3) layout (the layers take inputs in either)."""
    for layer in module.modules():
        if isinstance(layer, WinogradConv2d):
            continue
        for param in layer.parameters(recurse=False):
            if param.dim() == 4:
                param.data = param.data.contiguous(memory_format=torch.channels_last)
        for key, buf in layer.named_buffers(recurse=False):
            if buf.dim() == 4:
                layer._buffers[key] = buf.contiguous(memory_format=torch.channels_last)
    return module


def trim_heap() -> None:
    """Return the C heap's free memory to the system (glibc keeps freed blocks below its mmap threshold,
    which grows after large frees, so a freed sub-model would otherwise stay in resident memory). The reusable
    buffers of the Winograd convolutions and of the fp32 GEGLU kernel are freed first."""
    release_workspace()
    release_fp32_workspace()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


# glibc's mallopt parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -3, -4
# blocks up to this size come from the heap, not from a fresh mmap (glibc's own ceiling for the threshold: 32 MiB on
# 64-bit); a bf16 UNet step's activations are all below it (SD 1.5 at 512^2: 21 MiB at most), but fp32 ones are not
# (42 MiB GEGLU halves, 63 MiB concatenations), so mmap is not used at all (M_MMAP_MAX 0): larger blocks come from
# the heap too
HEAP_MMAP_THRESHOLD = 32 << 20
# free memory at the heap's top is returned only above this (and by trim_heap, which the engine calls after
# sampling and whenever it frees a network)
HEAP_TRIM_THRESHOLD = 1 << 30
_heap_tuned = False


def tune_heap() -> bool:
    """Keep a sampling loop's activations in the C heap between steps (glibc: once per process; False elsewhere).

    With glibc's defaults every large activation is a fresh mmap, or memory trimmed from the heap's top and faulted
    back in at the next step: 72,000 page faults (281 MB) in each SD 1.5 512^2 bf16 UNet step, about 0.1 s of its
    2.3 s on a 2-core Zen 4. With a fixed 32 MiB mmap threshold and a 1 GiB trim threshold the steps after the first
    fault nothing (measured: 0) and run 4-6% faster; :func:`trim_heap` still hands the memory back after sampling,
    so peak and idle memory do not grow. Blocks over 32 MiB (fp32 activations at 512^2 and up) would still be fresh
    mmaps, so mmap is turned off: the exact 512^2 step under the AVX2 cap ran 6.97 s with them, 6.54 s without."""
    global _heap_tuned
    if _heap_tuned:
        return True
    if _LIBC is None or not hasattr(_LIBC, "mallopt"):
        return False
    _heap_tuned = bool(_LIBC.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD)) and \
        bool(_LIBC.mallopt(M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD)) and bool(_LIBC.mallopt(M_MMAP_MAX, 0))
    return _heap_tuned


def check_memory_mode(mode) -> int:
    if mode not in MEMORY_MODES:
        valid = "; ".join(f"{k} = {v}" for k, v in MEMORY_MODES.items())
        raise MemoryModeError(f"memory mode {mode!r} is not valid: {valid}")
    return mode


def stream_units(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks whose weights are materialised together: ResBlocks, spatial transformers and resamplers, and
    the model's remaining top-level layers. Every parameter belongs to exactly one unit, except the model's own
    (Z-Image's pad tokens: vectors its forward reads directly), which stay resident."""
    units: list[tuple[str, nn.Module]] = []
    covered: set[str] = set()

    def visit(prefix: str, module: nn.Module):
        for name, child in module.named_children():
            path = f"{prefix}{name}"
            if isinstance(child, _UNIT_TYPES) or not any(True for _ in child.children()):
                if any(True for _ in child.parameters(recurse=True)):
                    units.append((path, child))
                    covered.update(f"{path}.{k}" for k, _ in child.named_parameters())
            else:
                visit(f"{path}.", child)

    visit("", model)
    covered.update(k for k, _ in model.named_parameters(recurse=False))
    missing = [k for k, _ in model.named_parameters() if k not in covered]
    if missing:  # a structural bug, not a user error
        raise RuntimeError(f"parameters outside every streaming unit: {missing[:5]}")
    return units


class WeightStreamer:
    """Materialises each unit's weights just before it runs and drops them right after.

    ``provider(key)`` returns the stored tensor of a parameter (canonical key); it is converted to ``dtype`` on
    ``device`` for the unit's forward pass. ``release()`` is called after each unit (e.g. to hand the file
    pages back to the kernel).
    """

    def __init__(self, model: nn.Module, provider, dtype: torch.dtype, device, release=None):
        self.model, self.provider, self.dtype, self.device, self.release = model, provider, dtype, device, release
        self.units = stream_units(model)
        self._handles = []
        self._placeholders: dict[str, nn.Parameter] = {}
        for path, unit in self.units:
            names = [(f"{path}.{k}", k) for k, _ in unit.named_parameters()]
            for key, _ in names:
                p = model.get_parameter(key)
                self._placeholders[key] = nn.Parameter(torch.empty(p.shape, device="meta", dtype=self.dtype),
                                                       requires_grad=False)
            self._handles.append(unit.register_forward_pre_hook(self._loader(unit, names)))
            self._handles.append(unit.register_forward_hook(self._dropper(unit, names)))
        self._drop_all()
        for key, _ in list(model.named_parameters(recurse=False)):   # the model's own vectors: resident
            tensor = provider(key)
            if isinstance(tensor, QuantizedTensor):
                tensor = tensor.dequantize(self.dtype)
            model._parameters[key] = nn.Parameter(tensor.to(device=self.device, dtype=self.dtype),
                                                  requires_grad=False)

    @staticmethod
    def _owner(unit: nn.Module, local: str) -> tuple[nn.Module, str]:
        path, _, leaf = local.rpartition(".")
        return (unit.get_submodule(path) if path else unit), leaf

    def _loader(self, unit, names):
        # an embedding table alone (an LLM's, 152064 x 3584 for Qwen2.5-VL): only the rows its ids read are made
        if isinstance(unit, nn.Embedding) and [local for _, local in names] == ["weight"]:
            return self._row_loader(unit, names[0][0])

        def hook(module, args):
            for key, local in names:
                owner, leaf = self._owner(unit, local)
                tensor = self.provider(key)
                if isinstance(tensor, QuantizedTensor):   # a GGUF block format: dense for this block's run
                    tensor = tensor.dequantize(self.dtype)
                tensor = tensor.to(device=self.device, dtype=self.dtype)
                owner._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)
        return hook

    def _row_loader(self, unit: nn.Embedding, key: str):
        """An embedding's pre-hook that gathers the rows of the ids it is called with (each once; a GGUF block
        format's rows dequantised alone) as its weight, and hands its forward the ids' places among them: the same
        vectors, without materialising the table."""
        def hook(module, args):
            ids = args[0]
            rows, places = torch.unique(ids.detach().cpu(), return_inverse=True)
            stored = self.provider(key)
            if isinstance(stored, QuantizedTensor):
                picked = [stored.rows(i, i + 1).data for i in rows.tolist()]
                gathered = QuantizedTensor(torch.cat(picked), stored.type, (len(picked), *stored.shape[1:]))
                weight = gathered.dequantize(self.dtype)
            else:
                weight = stored.index_select(0, rows.to(stored.device))
            unit._parameters["weight"] = nn.Parameter(weight.to(device=self.device, dtype=self.dtype),
                                                      requires_grad=False)
            return (places.view(ids.shape).to(ids.device), *args[1:])
        return hook

    def _dropper(self, unit, names):
        def hook(module, args, output):
            for key, local in names:
                owner, leaf = self._owner(unit, local)
                owner._parameters[leaf] = self._placeholders[key]
            if self.release is not None:
                self.release()
        return hook

    def _drop_all(self):
        for key, placeholder in self._placeholders.items():
            owner, leaf = self._owner(self.model, key)
            owner._parameters[leaf] = placeholder

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles.clear()


def streamed_model(ckpt: Checkpoint, component: str, dtype: torch.dtype, device="cpu",
                   keep_pages: bool = False, weight_dtype: torch.dtype | None = None) -> nn.Module:
    """``component`` built with no resident weights: each block's weights come from the checkpoint when it runs.

    ``keep_pages=False`` (memory mode 0): the file pages are released after every block. ``keep_pages=True``
    with ``weight_dtype``: the weights stay resident in ``weight_dtype`` (zero-copy when the file stores that
    dtype) and are converted to ``dtype`` block by block.
    """
    module = ckpt.build_empty(component)
    source = ckpt.sources[component]
    if keep_pages:
        stored = {}
        for key in dict(module.named_parameters()):
            t = source.view[key]
            stored[key] = t if weight_dtype is None or isinstance(t, QuantizedTensor) or t.dtype == weight_dtype \
                else t.to(weight_dtype)
        provider = stored.__getitem__
        release = None
    else:
        provider = source.view.__getitem__
        release = ckpt.release_pages
    for key, buf in list(module.named_buffers()):  # buffers are tiny: resident
        owner, _, leaf = key.rpartition(".")
        (module.get_submodule(owner) if owner else module)._buffers[leaf] = source.view[key].to(device)
    module._streamer = WeightStreamer(module, provider, dtype, device, release)
    return module.eval().requires_grad_(False)


# The networks whose weights are prepacked. Not the text encoder: it runs once per prompt, so each of its layers
# would reorder its weight once either way, and the 72 reorders (about 10 ms each: oneDNN sets up a primitive for
# each) only delay the first text encoding.
PREPACKED = ("unet", "vae")
# the networks whose GGUF block-format weights stay quantised in memory (engine.lowbit); an LLM text encoder (Qwen,
# in the text_encoder slot) too: ModelManager.keeps_blocks
LOW_BIT_NETWORKS = ("transformer", "text_encoder_3")


class ModelManager:
    """Hands out the three networks according to the memory mode; ``use(name)`` is a context manager."""

    def __init__(self, ckpt: Checkpoint | None, mode: int = 1, dtype: torch.dtype = torch.float32, device="cpu",
                 weight_dtype: torch.dtype | None = None, preloaded: StableDiffusion | None = None,
                 quantize: str = "none", prepack: bool | None = None, vae_dtype: torch.dtype | None = None,
                 winograd: bool | None = None, text_dtype: torch.dtype | None = None, channels_last: bool = False,
                 compile: bool = False, fp32_kernels: bool = False, t5_dtype: torch.dtype | None = None,
                 lowbit: str = "none"):
        self.ckpt, self.mode, self.dtype, self.device = ckpt, check_memory_mode(mode), dtype, torch.device(device)
        # the VAE's own compute dtype where it differs (SDXL's VAE decodes in fp32 under half-precision compute)
        self.vae_dtype = vae_dtype
        # the text encoders' where it differs (the bf16 precision keeps CLIP in fp32), and T5's where it differs again
        # (bf16 under the bf16 precisions)
        self.text_dtype = text_dtype
        self.t5_dtype = t5_dtype
        # the UNet's and VAE's weights channels-last, so that their convolutions (and everything between them) run
        # channels-last end to end (the bf16 precision, sdlite.engine.precision)
        self.channels_last = channels_last
        # the UNet's, VAE's (and a ControlNet's) attention and GEGLU on sdlite's fp32 kernels (the fp32-fast
        # precision, sdlite.kernels.fp32)
        self.fp32_kernels = fp32_kernels
        # the UNet run through torch.compile (engine.compile) where that applies
        if not isinstance(compile, bool):
            raise MemoryModeError(f"compile {compile!r} is not valid: expected True or False")
        self.compile = compile
        self._compiled: dict[str, object] = {}
        # fp32 CPU weights reordered once for oneDNN (engine.packing); None: where it applies and this CPU gains
        # from it (engine.cpu: decided by the ISA flags, or by a short cached measurement)
        available = prepack_available(self.device, dtype)
        self.prepack = (available and default_prepack().use) if prepack is None else bool(prepack)
        self._prepack_default = prepack is None
        if self.prepack and not available:
            raise MemoryModeError(f"prepacked weights need fp32 compute on a CPU with oneDNN; this is {dtype} on "
                                  f"{self.device.type}")
        # the UNet's and VAE's large-map 3x3 convolutions by Winograd's F(2x2, 3x3) (engine.winograd); None: where
        # it applies (fp32 on a CPU), on every ISA
        self.winograd = winograd_available(self.device, dtype) if winograd is None else bool(winograd)
        if self.winograd and not winograd_available(self.device, dtype):
            raise MemoryModeError(f"Winograd convolutions need fp32 compute on a CPU; this is {dtype} on "
                                  f"{self.device.type}")
        self.weight_dtype = weight_dtype
        check_quantize_supported(quantize)  # a valid mode, and bf16 ones only on CPUs with bf16 kernels
        self.quantize = quantize
        if quantize != "none" and (mode == 0 or weight_dtype is not None):
            raise MemoryModeError(f"quantize mode {quantize!r} needs the UNet loaded whole (or the transformer: "
                                  "its int8 layers are packed once, at load), which memory mode 0 streams from the "
                                  "file block by block: use memory mode 1 or 2 and no weight dtype (or, for mode 0, "
                                  "--precision bf16)")
        # the transformer's block Linears kept in int8 / int4 (engine.lowbit; T5's in int8), or all its Linears in
        # fp8: quantised as they load
        if lowbit != "none":
            check_low_bit_mode(lowbit)
            if mode == 0 or weight_dtype is not None:
                what = "weight storage" if lowbit in FP8_MODES else "precision"
                raise MemoryModeError(f"{what} {lowbit!r} keeps the transformer's weights quantised in memory; memory "
                                      "mode 0 (or a weight dtype) streams them from the file block by block instead: "
                                      "use memory mode 1 or 2 (or, for mode 0, a GGUF file or --precision bf16)")
        self.lowbit = lowbit
        self._resident: dict[str, nn.Module] = {}
        if preloaded is not None:
            self._resident = dict(preloaded.networks())
        # callables (name, module, resident) run on every network built from now on: how a LoRA applied for a
        # request (sdlite.adapters.lora.engine_with_loras) reaches the networks memory modes 0 and 2 load per use
        self.adapters: list = []
        # the merged layers of the last request with LoRAs, restored but kept for the next with the same ones
        # (memory mode 1; sdlite.adapters.lora.engine_with_loras)
        self.kept_loras = None

    def adapted(self, name: str) -> bool:
        """Whether an adapter applied now (a request's LoRAs) changes network ``name``'s weights: one that names the
        networks it touches (its ``components``) where it names ``name``, one that names none always."""
        return any(name in getattr(adapter, "components", (name,)) for adapter in self.adapters)

    def _adapt(self, name: str, module: nn.Module, resident: bool) -> None:
        for adapter in list(self.adapters):
            adapter(name, module, resident)

    @property
    def denoiser(self) -> str:
        """The network that denoises (the UNet, or SD3's transformer): the one memory modes 0 and 2 keep."""
        return self.ckpt.spec.denoiser if self.ckpt is not None else "unet"

    def _keeps(self, name: str) -> bool:
        return self.mode == 1 or (self.mode in (0, 2) and name == self.denoiser)

    def _streams(self, name: str) -> bool:
        """Whether the network's weights are streamed block by block (on the meta device between blocks)."""
        if self.low_bit_mode(name) != "none":
            return False
        return self._streams_from_file(name) or (self.weight_dtype is not None and self.weight_dtype != self.dtype)

    def _streams_from_file(self, name: str) -> bool:
        """Memory mode 0 streams the UNet (or transformer), SDXL's text encoders (bigG alone is 2.8 GB in fp32), T5
        (SD3's third encoder, 19 GB in fp32) and an LLM text encoder (Qwen3-4B: 8 GB in bf16) from the file, its
        pages handed back after each block."""
        return self.mode == 0 and (name == self.denoiser or (name in TEXT_ENCODERS and self.ckpt is not None
                                                             and self.ckpt.spec.is_sdxl)
                                   or name == "text_encoder_3"
                                   or isinstance(self._text_config(name), QwenConfig))

    def dtype_of(self, name: str) -> torch.dtype:
        """The compute dtype of network ``name``."""
        if name == "vae" and self.vae_dtype is not None:
            return self.vae_dtype
        if name in TEXT_ENCODERS and self.t5_dtype is not None and self._is_t5(name):
            return self.t5_dtype
        if name in TEXT_ENCODERS and self.text_dtype is not None:
            return self.text_dtype
        return self.dtype

    def _is_t5(self, name: str) -> bool:
        return isinstance(self._text_config(name), T5Config)

    def _text_config(self, name: str):
        spec = self.ckpt.spec if self.ckpt is not None else None
        field = {"text_encoder": "text", "text_encoder_2": "text2", "text_encoder_3": "text3"}.get(name)
        return getattr(spec, field, None) if spec is not None and field is not None else None

    def keeps_blocks(self, name: str) -> bool:
        """Whether network ``name``'s GGUF block-format Linear weights stay in their blocks in memory (dequantised
        layer by layer as they run, :mod:`sdlite.engine.lowbit`) rather than dequantised as they load: a transformer's,
        T5's and an LLM text encoder's (Qwen3-4B's 3.6 billion Linear weights: 14.5 GB in fp32, 2.2 GB in Q4_K_M)."""
        return name in LOW_BIT_NETWORKS or isinstance(self._text_config(name), QwenConfig)

    def _build(self, name: str) -> nn.Module:
        if self._streams_from_file(name):
            return self._kernels(name, streamed_model(self.ckpt, name, self.dtype_of(name), self.device))
        if self._streams(name):
            return self._kernels(name, streamed_model(self.ckpt, name, self.dtype_of(name), self.device,
                                                      keep_pages=True, weight_dtype=self.weight_dtype))
        return self._load_whole(name)

    def _kernels(self, name: str, module: nn.Module) -> nn.Module:
        """``module`` (network ``name``) with its attention and GEGLU marked for sdlite's fp32 kernels where the
        precision asks for them (the UNet or a transformer's attention, the VAE and a ControlNet beside the UNet)."""
        if self.fp32_kernels and name in ("unet", "transformer", "vae", "controlnet"):
            use_fp32_kernels(module)
        return module

    def low_bit_mode(self, name: str) -> str:
        """How the int8 / int4 precisions store network ``name``'s block Linears: the transformer as the precision
        says, T5 (``text_encoder_3``) and an LLM text encoder (Qwen) in int8 under both (4-bit encoders are not
        measured against exact; int8 halves T5's 9.5 GB and Qwen3-4B's 8 GB of bf16 weights), every other network
        "none". The fp8 storages (ComfyUI's UNETLoader ``weight_dtype``) are the transformer's alone."""
        if self.lowbit == "none" or not self.keeps_blocks(name):
            return "none"
        if self.lowbit in FP8_MODES:
            return self.lowbit if name == "transformer" else "none"
        return self.lowbit if name == "transformer" else "int8"

    def _load_whole(self, name: str) -> nn.Module:
        lowbit = self.low_bit_mode(name)
        if lowbit != "none" and self.ckpt is not None:
            module = load_quantized(self.ckpt, name, self.dtype_of(name), self.device, lowbit)
            trim_heap()   # the quantising's float32 temporaries, which the tuned heap would otherwise keep
            return self._kernels(name, module)
        # the UNet's int8 layers, or under bf16-int8 a transformer's block Linears (a GGUF file's dequantised, then
        # quantised: int8 compute, no per-call dequantising)
        quantized = self.quantize != "none" and (name == "unet" or (
            self.quantize == "bf16-int8" and name == "transformer" and name == self.denoiser)
            or self._t5_int8(name))
        # GGUF weights in a block format stay in it where the dense network would be large (a transformer, T5, an LLM
        # encoder): dequantised layer by layer as they run. Other networks' are dequantised as they load (and prepacked)
        low_bit = quantized_linears(self.ckpt, name) if self.keeps_blocks(name) and not quantized else {}
        if low_bit:
            return self._kernels(name, load_low_bit(self.ckpt, name, self.dtype_of(name), self.device, low_bit))
        winograd = self.winograd and name in PREPACKED and not quantized and self.dtype_of(name) == torch.float32
        if self._prepacks(name) and not quantized:
            # the same as loading and then prepacking, in one pass
            return self._kernels(name, load_prepacked(self.ckpt, name, winograd=winograd))
        if quantized and self.quantize == "bf16-int8" and torch.device(self.device).type == "cpu":
            module = load_bf16_int8(self.ckpt, name, self.dtype_of(name))   # no bf16 copy of the int8 layers
        else:
            module = self.ckpt.load(name, self.dtype_of(name), self.device)
            if quantized:
                module = quantize_model(module, self.quantize)
        if winograd:
            # the weights are plain here (a prepacked load returned above), so the wide rule applies
            module = winograd_model(module, wide=True, fast=self.fp32_kernels)
        if self._prepacks(name):
            module = prepack_model(module)
        if name == "vae" and self._phase_upsamples(self.dtype_of(name)):
            module = phase_upsample_model(module)
        if self.channels_last and name in ("unet", "vae"):
            module = channels_last(module)
        if self.channels_last and name == "unet" and shape_packs(self.device, self.dtype_of(name)):
            module = shape_pack_model(module)   # its bf16 1x1 convolutions' weights packed per input shape
        return self._kernels(name, module)

    def _t5_int8(self, name: str) -> bool:
        """Whether bf16-int8 makes network ``name``'s block Linears int8: T5 loaded whole from a dense file (per-token
        activations, outlier columns in float: :func:`sdlite.engine.quant.t5_int8_targets`). A GGUF T5 keeps its
        blocks (less memory), a streamed one (memory mode 0) stays bf16, as a streamed transformer does."""
        return (self.quantize == "bf16-int8" and name in TEXT_ENCODERS and self._is_t5(name)
                and torch.device(self.device).type == "cpu" and self.dtype_of(name) == torch.bfloat16
                and self.ckpt is not None and not in_gguf(self.ckpt, name))

    def _phase_upsamples(self, dtype: torch.dtype) -> bool:
        """Whether a decoder computing in ``dtype`` here upsamples by phases (:mod:`sdlite.engine.subpixel`): under
        bf16 on a CPU, where its upsampling convolutions take 16 products per small pixel instead of 36 (SD 1.5's
        VAE decode at 512^2: 2.78 -> 2.46 s; a TAESD's: 0.165 -> 0.155 s, a 2-core AMD EPYC); never in fp32, the exact
        path's. (The bf16-int8 UNet's upsamplers stay as they are: see engine.subpixel.)"""
        return dtype == torch.bfloat16 and torch.device(self.device).type == "cpu"

    def adapt_like_unet(self, module: nn.Module) -> nn.Module:
        """A network that runs beside the UNet at its shapes (a ControlNet), loaded whole in the UNet's compute dtype,
        given the UNet's kernels: Winograd's 3x3 convolutions and prepacked weights where the UNet has them (fp32),
        channels-last where the UNet is."""
        prepacks = self._prepacks("unet")
        if self.winograd and self.quantize == "none" and self.dtype_of("unet") == torch.float32:
            # the UNet's rule: beside prepacked layers the narrow one, else the wide one (as _load_whole)
            module = winograd_model(module, wide=not prepacks, fast=self.fp32_kernels and not prepacks)
        if prepacks:
            module = prepack_model(module)
        if self.channels_last:
            module = channels_last(module)
            if shape_packs(self.device, self.dtype_of("unet")):
                module = shape_pack_model(module)
        return self._kernels("controlnet", module)

    def adapt_like_vae(self, module: nn.Module) -> nn.Module:
        """A copy of a decoder that stands in for the VAE (a TAESD), computing in the VAE's dtype and memory format
        here (bf16 and channels-last under the bf16 precisions: about 3x fp32's speed on a CPU with AMX).

        Its 3x3 convolutions stay PyTorch's: with 64 channels on maps up to the image's size, Winograd's transforms
        cost more than they save (a 64-channel layer at 512x512 took 2.4 s by F(4x4, 3x3) against 0.56 s
        channels-last, on a busy 2-core Xeon with AMX), and plain layers keep the ``exact`` path's TAESD bit for
        bit diffusers'. The module given is left as it was (a server shares one TAESD between models)."""
        import copy

        module = copy.deepcopy(module).to(device=self.device, dtype=self.dtype_of("vae"))
        if self._phase_upsamples(self.dtype_of("vae")):
            module = phase_upsample_model(module)
        return channels_last(module) if self.channels_last else module

    def _prepacks(self, name: str) -> bool:
        """Whether network ``name``'s weights are prepacked: where the rule says so, except a UNet that is compiled
        (Inductor takes oneDNN-prepacked weights only as constants of a frozen graph; engine.compile)."""
        if not (self.prepack and name in PREPACKED):
            return False
        if self.compile and self._prepack_default:
            from .compile import compiles
            return not compiles(self, name)
        return True

    def _discard(self, module: nn.Module) -> None:
        # the caller may still hold the module object: empty it, so its weights are freed regardless
        release_packed(module)
        module.to(device="meta")
        self.free()

    def get(self, name: str) -> nn.Module:
        """The network, resident from now on (modes 1 and 2 for the UNet)."""
        if name not in self._resident:
            module = self._build(name)
            self._adapt(name, module, True)
            self._resident[name] = module
        return self._resident[name]

    @contextlib.contextmanager
    def use(self, name: str):
        if name in self._resident or self._keeps(name):
            yield self.get(name)
            return
        module = self._build(name)
        try:
            self._adapt(name, module, False)
            yield module
        finally:
            self._discard(module)

    @contextlib.contextmanager
    def use_whole(self, name: str):
        """Like :meth:`use`, but with every weight in memory for the duration, also where the network normally
        streams its weights block by block: for callers such as tiled decoding that call its layers piecewise
        rather than through the blocks' ``forward``. A whole copy made for the purpose is freed after."""
        if not self._streams(name):
            with self.use(name) as module:
                yield module
            return
        module = self._load_whole(name)
        try:
            self._adapt(name, module, False)
            yield module
        finally:
            self._discard(module)

    def runner(self, name: str, module: nn.Module):
        """What to call to run ``module`` (network ``name``, from :meth:`use`): the module, or with ``compile`` its
        compiled forward (:mod:`sdlite.engine.compile`: one per resident network, eager where it does not apply)."""
        if not self.compile:
            return module
        from .compile import runner_for

        return runner_for(self, name, module)

    def free(self) -> None:
        """Hand freed memory back: Python objects, the allocators' caches and the file pages read so far."""
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        trim_heap()
        if self.ckpt is not None:
            self.ckpt.release_pages()

    def resident(self) -> list[str]:
        return sorted(self._resident)
