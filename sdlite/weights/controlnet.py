"""The ControlNets users have, read into :class:`~sdlite.models.controlnet.ControlNet`.

Forms read:

* lllyasviel's original files (``control_sd15_canny.pth``, ``control_v11p_sd15_canny.pth`` / ``.safetensors``, fp16
  or fp32): the original UNet layout under ``control_model.`` plus ``input_hint_block.N``, ``zero_convs.N.0`` and
  ``middle_block_out.0``; ``.pth`` files are read by :mod:`sdlite.weights.io`, which never runs pickled code;
* the same keys without the prefix (the SD 2.1 ControlNets);
* diffusers ``ControlNetModel`` folders (``config.json`` + ``diffusion_pytorch_model[.fp16].safetensors|bin``) and
  single files with diffusers keys (SDXL ControlNets are mostly published so), SD 1.x, 2.x and SDXL alike.

The architecture comes from the shapes (a folder's config.json where there is one): widths, levels, attention,
transformer depth, the context width and SDXL's added conditioning. Attention head counts leave no trace in the
shapes; they follow the family's convention (SD 1.x 8 heads, SD 2.x and SDXL 64-wide heads), which is the base
model's. Other kinds of control files are refused by name: control-LoRA, T2I-Adapter, union ControlNets,
ControlLLLite, ControlNet-XS, IP-Adapter. A ControlNet made for another family than the model is refused with both
named (:func:`check_compatible`).
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..config import ConfigError, ControlNetConfig, UNetConfig
from ..errors import CheckpointError
from ..models.controlnet import ControlNet
from .detect import describe
from .io import open_checkpoint
from .plan import COPY, ComponentPlan, PlanEntry, UnsupportedModelError
from .store import TensorStore
from .unet_keys import CONTROLNET_PREFIX, controlnet_from_original, infer_unet, unet_structure_from_keys

__all__ = ["ControlNetError", "ControlNetFile", "open_controlnet", "load_controlnet", "check_compatible",
           "family_name", "EXTENSIONS"]

EXTENSIONS = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
DIFFUSERS_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.fp16.safetensors",
                     "diffusion_pytorch_model.bin", "diffusion_pytorch_model.fp16.bin")
COMPONENT = "controlnet"
_HINT_BLOCK = re.compile(r"input_hint_block\.(\d+)\.weight$")
_MAX_LISTED = 5

# diffusers config classes that are control models of kinds not supported yet, by what users call them
_OTHER_CLASSES = {
    "ControlNetUnionModel": "a union ControlNet (one network for several control types, e.g. controlnet-union-sdxl)",
    "ControlNetXSAdapter": "a ControlNet-XS adapter", "UNetControlNetXSModel": "a ControlNet-XS model",
    "T2IAdapter": "a T2I-Adapter", "MultiAdapter": "a T2I-Adapter", "SparseControlNetModel": "a SparseCtrl ControlNet",
    "SD3ControlNetModel": "an SD3 ControlNet", "FluxControlNetModel": "a Flux ControlNet",
    "HunyuanDiT2DControlNetModel": "a HunyuanDiT ControlNet",
}


class ControlNetError(CheckpointError):
    """A ControlNet file or folder that cannot be used (the message names the file, and the key or shape at
    fault)."""


def _other_kind(keys: list[str]) -> str | None:
    """What a control file that is not a plain ControlNet is, by its keys (None: nothing else recognised)."""
    def has(*parts):
        return any(any(p in k for p in parts) for k in keys)

    if "lora_controlnet" in keys or has("lora_controlnet"):
        return "a control-LoRA (Stability's control-lora-* files)"
    if has("task_embedding", "control_add_embedding.", "spatial_ch_projs", "transformer_layes."):
        return "a union ControlNet (one network for several control types, e.g. controlnet-union-sdxl / ProMax)"
    if has("lllite"):
        return "a ControlLLLite network (kohya's controllllite)"
    if any(k.startswith(("adapter.", "body.0.resnets.", "body.0.block1.", "body.0.body.")) for k in keys) \
            or (any(k.startswith("conv_in.") for k in keys) and any(k.startswith("body.") for k in keys)):
        return "a T2I-Adapter"
    if has("ctrl_to_base", "base_to_ctrl", "control_to_base_for_"):
        return "a ControlNet-XS"
    if any(k.startswith(("image_proj.", "ip_adapter.")) for k in keys):
        return "an IP-Adapter"
    return None


@dataclass
class ControlNetFile:
    """An opened ControlNet: what it is and its weights under canonical names, read on demand. It answers as a
    one-component checkpoint (``sources``, :meth:`build_empty`, :meth:`release_pages`), so memory mode 0 streams it
    block by block like the UNet (:func:`sdlite.engine.memory.streamed_model`)."""

    path: Path
    name: str                  # what A1111 lists: the file's stem, or the folder's name
    layout: str                # "diffusers" | "original" | "original (no prefix)"
    config: ControlNetConfig
    sources: dict              # {"controlnet": ComponentSource}
    stores: list = field(default_factory=list, repr=False)

    def build_empty(self, component: str = COMPONENT) -> nn.Module:
        with torch.device("meta"):
            module = ControlNet(self.config)
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        source = self.sources[COMPONENT]
        missing = [k for k in expected if k not in source.shapes]
        if missing:
            raise ControlNetError(f"is missing {len(missing)} ControlNet tensors for the architecture its shapes "
                                  f"show, first few: {_listing(missing)}", self.path, source.file_key(missing[0]))
        for key, shape in expected.items():
            if tuple(source.shapes[key]) != shape:
                raise ControlNetError(f"has shape {tuple(source.shapes[key])}, expected {shape} for this "
                                      "ControlNet's architecture", self.path, source.file_key(key))
        return module

    def tensor(self, key: str) -> torch.Tensor:
        source = self.sources[COMPONENT]
        try:
            return source.view[key]
        except CheckpointError:
            raise
        except Exception as e:
            raise ControlNetError(f"cannot read the tensor: {e}", self.path, source.file_key(key)) from None

    def load(self, dtype: torch.dtype = torch.float32, device="cpu") -> ControlNet:
        """The network, every weight converted to ``dtype`` on ``device``."""
        module = self.build_empty()
        state = {}
        for key, value in module.state_dict().items():
            t = self.tensor(key)
            state[key] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype)
            if t.data_ptr() == state[key].data_ptr():   # zero-copy view of the mapped file: keep it independent
                state[key] = state[key].clone()
        module.load_state_dict(state, strict=True, assign=True)
        self.release_pages()
        return module.eval().requires_grad_(False)

    def release_pages(self) -> None:
        for store in self.stores:
            store.release_pages()

    def close(self) -> None:
        for store in self.stores:
            store.close()
        self.stores.clear()


def _listing(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:_MAX_LISTED]) + (", ..." if len(keys) > _MAX_LISTED else "")


def family_name(unet: UNetConfig) -> str:
    """What users call the family of a (ControlNet's) UNet config: SD 1.x, SD 2.x, SDXL or a description."""
    if unet.addition_embed == "text_time":
        return "SDXL" if unet.context_dim == 2048 else f"SDXL-like (context width {unet.context_dim})"
    names = {768: "SD 1.x", 1024: "SD 2.x"}
    if unet.context_dim in names and unet.block_channels == (320, 640, 1280, 1280):
        return names[unet.context_dim]
    return f"a UNet of widths {list(unet.block_channels)} and context width {unet.context_dim}"


def check_compatible(cfg: ControlNetConfig, unet: UNetConfig, name: str, model_family: str) -> None:
    """Refuse a ControlNet whose residuals cannot go to ``unet`` (the model's), naming both families."""
    c = cfg.unet
    same = (c.block_channels == unet.block_channels and c.layers_per_block == unet.layers_per_block
            and c.context_dim == unet.context_dim and c.attention == unet.attention
            and (c.addition_embed, c.add_embed_in) == (unet.addition_embed, unet.add_embed_in))
    if same and c.norm_groups != unet.norm_groups:
        raise ControlNetError(f"normalises in {c.norm_groups} groups; the model's UNet in {unet.norm_groups} (a "
                              "config.json that says otherwise, or one for another model)", name)
    if not same:
        raise ControlNetError(f"is a ControlNet for {family_name(c)}; the model is {model_family} "
                              f"({family_name(unet)}): a ControlNet works with the family it was trained for", name)
    if c.in_channels not in (unet.in_channels, 4):
        raise ControlNetError(f"takes {c.in_channels} latent channels; the model's UNet takes {unet.in_channels}", name)


def open_controlnet(path: str | os.PathLike, base_unet: UNetConfig | None = None) -> ControlNetFile:
    """Open the ControlNet at ``path`` (a file or a diffusers folder), reading headers only. ``base_unet``: the
    model's UNet config, whose head counts the ControlNet takes where its widths are the same."""
    p = Path(path)
    if not p.exists():
        raise ControlNetError("no such file or folder (expected a ControlNet file or a diffusers ControlNetModel "
                              "folder)", p)
    if p.is_dir():
        return _open_folder(p, base_unet)
    if p.suffix.lower() not in EXTENSIONS:
        raise ControlNetError(f"is not a weights file (expected {', '.join(EXTENSIONS)})", p)
    store = open_checkpoint(p)
    try:
        return _open_file(p, store, base_unet)
    except BaseException:
        store.close()
        raise


def load_controlnet(path: str | os.PathLike, base_unet: UNetConfig | None = None, dtype=torch.float32,
                    device="cpu") -> ControlNet:
    """Open and load in one call (the file is closed after; the module owns its weights)."""
    cfile = open_controlnet(path, base_unet)
    try:
        module = cfile.load(dtype, device)
    finally:
        cfile.close()
    module.name = cfile.name
    return module


# --- the layouts ---------------------------------------------------------------------------------------------------


def _open_folder(folder: Path, base_unet: UNetConfig | None) -> ControlNetFile:
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ControlNetError("is a folder without config.json (expected a diffusers ControlNetModel folder)", folder)
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ControlNetError(f"is not a readable JSON config ({e})", config_file) from None
    cls = raw.get("_class_name", "ControlNetModel")
    if cls in _OTHER_CLASSES:
        raise ControlNetError(f"is {_OTHER_CLASSES[cls]} ({cls}), which sdlite does not support yet", folder)
    if cls != "ControlNetModel":
        raise ControlNetError(f"is a {cls} folder, not a ControlNetModel", config_file)
    files = [folder / n for n in DIFFUSERS_WEIGHTS if (folder / n).is_file()]
    if not files:
        raise ControlNetError(f"has no weights file (expected one of {', '.join(DIFFUSERS_WEIGHTS)})", folder)
    try:
        config = ControlNetConfig.from_diffusers(raw)
    except ConfigError as e:
        raise ControlNetError(str(e), config_file) from None
    store = open_checkpoint(files[0])
    try:
        keys = list(store.keys())
        plan = ComponentPlan(COMPONENT, {k: PlanEntry((k,), COPY) for k in keys})
        return _finish(folder, folder.name, "diffusers", config, plan, store, files[0])
    except BaseException:
        store.close()
        raise


def _open_file(path: Path, store: TensorStore, base_unet: UNetConfig | None) -> ControlNetFile:
    keys = list(store.keys())
    other = _other_kind(keys)
    if other is not None:
        raise ControlNetError(f"is {other}, which sdlite does not support yet (supported: ControlNets in "
                              "lllyasviel's layout or diffusers')", path)
    if any(k.startswith(CONTROLNET_PREFIX + "input_hint_block.") for k in keys):
        layout, prefix = "original", CONTROLNET_PREFIX
    elif any(k.startswith("input_hint_block.") for k in keys):
        layout, prefix = "original (no prefix)", ""
    elif any(k.startswith("controlnet_cond_embedding.") for k in keys):
        plan = ComponentPlan(COMPONENT, {k: PlanEntry((k,), COPY) for k in keys})
        shapes = plan.shapes({k: store.shape(k) for k in keys})
        config = _config_from_shapes(path, shapes, base_unet)
        return _finish(path, path.stem, "diffusers", config, plan, store, path)
    else:
        what = describe(keys)
        raise ControlNetError(f"is not a ControlNet ({what or 'a Stable Diffusion model'}; a ControlNet has "
                              "'control_model.input_hint_block.0.weight' or 'controlnet_cond_embedding.conv_in.weight')",
                              path)
    try:
        structure = unet_structure_from_keys(keys, "original", prefix=prefix, encoder_only=True)
    except UnsupportedModelError as e:
        raise ControlNetError(str(e), path) from None
    hint = sorted(int(m.group(1)) for k in keys if k.startswith(prefix)
                  and (m := _HINT_BLOCK.match(k[len(prefix):])))
    if len(hint) < 2 or hint != list(range(0, 2 * len(hint), 2)):
        raise ControlNetError(f"has hint-encoder convolutions {hint} (expected input_hint_block.0, .2, .4 ...)", path)
    plan = controlnet_from_original(keys, structure, len(hint), prefix=prefix)
    shapes = plan.shapes({k: store.shape(k) for k in keys})
    config = _config_from_shapes(path, shapes, base_unet, global_pool=_yaml_pooling(path))
    return _finish(path, path.stem, layout, config, plan, store, path)


def _yaml_pooling(path: Path) -> bool:
    """A1111 reads a model's YAML beside it (``control_v11e_sd15_shuffle.yaml``): ``global_average_pooling: True``
    marks the shuffle ControlNet, whose residuals are averaged over space."""
    for suffix in (".yaml", ".yml"):
        y = path.with_suffix(suffix)
        if y.is_file():
            try:
                text = y.read_text(encoding="utf-8", errors="replace")
            except OSError:
                return False
            return bool(re.search(r"global_average_pooling:\s*true", text, re.IGNORECASE))
    return False


def _config_from_shapes(path: Path, shapes: dict, base_unet: UNetConfig | None,
                        global_pool: bool = False) -> ControlNetConfig:
    try:
        info = infer_unet({k: v for k, v in shapes.items() if not k.startswith("controlnet_")}, encoder_only=True)
    except UnsupportedModelError as e:
        raise ControlNetError(str(e), path) from None
    kwargs = info.config_kwargs()     # heads by the family's convention, where the widths allow one
    if base_unet is not None and base_unet.block_channels == info.block_channels:
        # what the shapes cannot tell is the base model's: head counts, norm groups and epsilon, SDXL's id width
        kwargs.update(heads=base_unet.heads, norm_groups=base_unet.norm_groups, norm_eps=base_unet.norm_eps)
        if info.add_embed_in:
            kwargs["addition_time_embed_dim"] = base_unet.addition_time_embed_dim
    if "heads" not in kwargs:
        raise ControlNetError(f"has widths {list(info.block_channels)} that do not tell its attention heads; load it "
                              "with the model it was made for", path)
    hint_in = shapes.get("controlnet_cond_embedding.conv_in.weight")
    blocks = sorted(int(m.group(1)) for k in shapes
                    if (m := re.match(r"controlnet_cond_embedding\.blocks\.(\d+)\.weight$", k)))
    if hint_in is None or len(blocks) % 2:
        raise ControlNetError("has no complete hint encoder (controlnet_cond_embedding / input_hint_block)", path)
    widths = (hint_in[0], *(shapes[f"controlnet_cond_embedding.blocks.{i}.weight"][0] for i in blocks[1::2]))
    try:
        return ControlNetConfig(unet=UNetConfig(**kwargs), hint_channels=hint_in[1], hint_widths=tuple(widths),
                                global_pool=global_pool)
    except ConfigError as e:
        raise ControlNetError(str(e), path) from None


def _finish(path: Path, name: str, layout: str, config: ControlNetConfig, plan: ComponentPlan, store: TensorStore,
            weights: Path) -> ControlNetFile:
    from ..loader import ComponentSource

    source = ComponentSource.from_plan(plan, store, (str(weights),))
    return ControlNetFile(path=path, name=name, layout=layout, config=config, sources={COMPONENT: source},
                          stores=[store])
