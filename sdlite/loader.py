"""Opening the checkpoints people have and building our models from them.

``open_model(path)`` reads only headers: it finds the layout (diffusers folder or original single file),
detects the family, builds the :class:`~sdlite.config.ModelSpec` and prepares a lazy canonical view of each
component's weights. ``Checkpoint.load(component)`` then builds one network straight into the compute dtype
(no tensor is read before its module needs it), so callers can hold one sub-model at a time.
``load_model(path)`` loads everything into a :class:`StableDiffusion`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from .config import (PRESETS, SD3_FAMILIES, X4_FAMILY, X4_LOW_RES_SCHEDULER, X4_MAX_NOISE_LEVEL, X4_SCALING_FACTOR, BertTextConfig,
                     ConfigError, ModelSpec, TextEncoderConfig, UNetConfig, VAEConfig, explicit_spacing, is_bert,
                     published_scheduler)
from .config.flux import FluxConfig
from .config.flux2 import Flux2Config
from .config.flux2_vae import Flux2VAEConfig
from .config.qwen import QwenConfig
from .config.qwenimage import QwenImageConfig
from .config.qwenimage_vae import QwenImageVAEConfig
from .config.zimage import ZImageConfig
from .errors import CheckpointError
from .models.bert import BertTextEncoder
from .models.clip import CLIPTextEncoder
from .models.flux import Flux
from .models.flux2 import Flux2
from .models.flux2_vae import Flux2VAE
from .models.mmdit import MMDiT
from .models.qwen import QwenTextEncoder
from .models.qwen_vision import QwenVLEncoder
from .models.qwenimage import QwenImage
from .models.qwenimage_vae import QwenImageVAE
from .models.t5 import T5Encoder
from .models.unet import UNet
from .models.vae import AutoencoderKL
from .models.zimage import ZImage
from .tokenizers.clip_bpe import SD1_PAD_TOKEN_ID, SD2_PAD_TOKEN_ID, CLIPTokenizer
from .tokenizers.t5 import T5Tokenizer
from .tokenizers import WordPieceTokenizer, tokenizer_kind
from .weights.convert import normalize_diffusers_keys, plan_from_original
from .weights.detect import Detection, detect
from .weights.folders import (LARGE_VAE, SHARED_FROM_KEY, component_folders as _component_folders,
                              component_store as _component_store, folder_tokenizer as _folder_tokenizer,
                              read_json as _read_json, storage_dtype as _storage_dtype,
                              text_architecture as _text_architecture, vae_folders as _vae_folders)
from .weights.io import open_checkpoint
from .weights.quants import QuantizedTensor
from .weights.flux import FLUX_PIPELINES, is_flux_file, open_flux_file, open_flux_folder
from .weights.flux2 import FLUX2_PIPELINES, is_flux2_file, open_flux2_file, open_flux2_folder
from .weights.sd3 import SD3_PIPELINES, is_sd3_file, open_sd3_file, open_sd3_folder
from .weights.store import ComponentSource, TensorStore
from .weights.text_keys import normalize_bert_keys
from .weights.vae_keys import vae_from_original
from .weights.qwenimage import (QWENIMAGE_EDIT_PIPELINES, QWENIMAGE_PIPELINES, is_qwenimage_file, open_qwenimage_file,
                                open_qwenimage_folder)
from .weights.zimage import ZIMAGE_PIPELINES, is_zimage_file, open_zimage_file, open_zimage_folder

COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3", "unet", "transformer", "vae")
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")
PREDICTION_TYPES = ("epsilon", "v_prediction")
_BUILDERS = {"text_encoder": CLIPTextEncoder, "text_encoder_3": T5Encoder, "unet": UNet, "transformer": MMDiT,
             "vae": AutoencoderKL}
# the networks their config's class names (FLUX.1's, Z-Image's, FLUX.2's and Qwen-Image's transformers and VAEs)
_BY_CONFIG = {FluxConfig: Flux, ZImageConfig: ZImage, Flux2Config: Flux2, Flux2VAEConfig: Flux2VAE,
              QwenImageConfig: QwenImage, QwenImageVAEConfig: QwenImageVAE}
_SPEC_FIELD = {"text_encoder": "text", "text_encoder_2": "text2", "text_encoder_3": "text3", "unet": "unet",
               "transformer": "transformer", "vae": "vae"}
# pipeline classes of the diffusers folders sdlite opens (model_index.json _class_name)
SD_PIPELINES = ("StableDiffusionPipeline", "StableDiffusionInpaintPipeline", "StableDiffusionImg2ImgPipeline")
SDXL_PIPELINES = ("StableDiffusionXLPipeline", "StableDiffusionXLImg2ImgPipeline")
X4_PIPELINES = ("StableDiffusionUpscalePipeline",)   # the SD x4 upscaler (run by sdlite.upscalers.x4)
_FOLDER_OPENERS = {**dict.fromkeys(SD3_PIPELINES, open_sd3_folder), **dict.fromkeys(FLUX_PIPELINES, open_flux_folder),
                   **dict.fromkeys(ZIMAGE_PIPELINES, open_zimage_folder), **dict.fromkeys(FLUX2_PIPELINES, open_flux2_folder),
                   **dict.fromkeys(QWENIMAGE_PIPELINES + QWENIMAGE_EDIT_PIPELINES, open_qwenimage_folder)}


def build_network(component: str, spec: ModelSpec) -> nn.Module:
    """The empty network of ``component`` for ``spec`` (a BERT or CLIP text encoder as the spec says)."""
    if component == "text_encoder" and is_bert(spec.text):
        return BertTextEncoder(spec.text)
    if component == "text_encoder_2":   # SDXL's OpenCLIP bigG, whose projection makes the pooled text embedding
        return CLIPTextEncoder(spec.text2, projection=True)
    if component == "text_encoder" and spec.family in SD3_FAMILIES:   # SD3's CLIP-L: its pooled output too
        return CLIPTextEncoder(spec.text, projection=True)
    config = getattr(spec, _SPEC_FIELD[component])
    if component in ("transformer", "vae") and type(config) in _BY_CONFIG:   # FLUX.1, Z-Image, FLUX.2, Qwen-Image
        return _BY_CONFIG[type(config)](config)
    if component == "text_encoder" and isinstance(spec.text, QwenConfig):   # an LLM as the text encoder (Z-Image)
        return QwenVLEncoder(spec.text) if spec.text.vision is not None else QwenTextEncoder(spec.text)
    return _BUILDERS[component](config)


def model_components(spec: ModelSpec) -> tuple[str, ...]:
    """The networks a model of ``spec`` has: its text encoder(s), the UNet (or transformer) and the VAE."""
    return (*spec.text_encoders, spec.denoiser, "vae")
_MAX_LISTED = 5
RELEASE_EVERY = 256 << 20  # bytes converted between releases of the file pages they were read from
# metadata keys of the single files we write: the prediction type in the modelspec convention, and the three
# configs (shapes cannot tell head counts, nor that an SD 2.x file lacks OpenCLIP's unused last block)
META_PREDICTION = "modelspec.prediction_type"
META_CONFIG = "sdlite.config"


def _listing(keys) -> str:
    keys = list(keys)
    return ", ".join(repr(k) for k in keys[:_MAX_LISTED]) + (", ..." if len(keys) > _MAX_LISTED else "")


@dataclass
class Checkpoint:
    """An opened checkpoint: what it is, and its components ready to be built on demand."""

    path: str
    layout: str                      # "diffusers" | "original"
    spec: ModelSpec
    detection: Detection
    storage_dtype: torch.dtype
    prediction_source: str           # how spec.prediction_type was decided
    sources: dict[str, ComponentSource]
    scheduler_config: dict           # timestep_spacing made explicit where the config implies it
    tokenizer_dir: str | None = None
    notes: list[str] = field(default_factory=list)
    tokenizer_2_dir: str | None = None   # SDXL: the second text encoder's tokenizer (pads with "!", id 0)
    scheduler_source: str = ""       # where scheduler_config (and its timestep spacing) came from
    # a diffusers AutoencoderTiny (TAESD) folder that decodes the images by default (an SDXS folder's vae/; its
    # AutoencoderKL, when it has one, is in vae_large/ and is the "vae" component)
    tiny_vae: str | None = None
    _stores: list[TensorStore] = field(default_factory=list, repr=False)
    # the files some loaded weights are zero-copy views of: their pages are never handed back (a page a user wrote,
    # e.g. a merged LoRA, would be lost); the other files' are
    _pinned: set = field(default_factory=set, repr=False)
    _tokenizer: CLIPTokenizer | WordPieceTokenizer | None = field(default=None, repr=False)  # built once
    _tokenizer_2: CLIPTokenizer | None = field(default=None, repr=False)
    _tokenizer_3: T5Tokenizer | None = field(default=None, repr=False)

    # -- components ------------------------------------------------------------------------------------

    @property
    def components(self) -> tuple[str, ...]:
        """The networks this model has (:func:`model_components`; no ``vae`` where a folder has only a tiny one)."""
        return tuple(c for c in model_components(self.spec) if c != "vae" or self.has_vae)

    @property
    def has_vae(self) -> bool:
        """Whether the model has an AutoencoderKL (a folder with only an AutoencoderTiny in vae/ has none)."""
        return "vae" in self.sources or self.tiny_vae is None

    def tokenizers(self) -> dict:
        """``{text encoder component: its tokenizer}``: one for SD 1.x/2.x, two for SDXL (the refiner: only the
        second encoder's), three for SD3 (CLIP-L's, bigG's, T5's)."""
        which = {"text_encoder": self.tokenizer, "text_encoder_2": self.tokenizer_2, "text_encoder_3": self.tokenizer_3}
        return {name: which[name]() for name in self.spec.text_encoders}

    def tokenizer_3(self) -> T5Tokenizer:
        """T5's tokenizer (SD3): the vocabulary shipped with sdlite, which every T5 v1.1 checkpoint shares."""
        if self._tokenizer_3 is None:
            self._tokenizer_3 = T5Tokenizer.from_package()
        return self._tokenizer_3

    def tokenizer_2(self) -> CLIPTokenizer:
        """The second text encoder's tokenizer: the folder's ``tokenizer_2``, else the packaged CLIP vocabulary
        padding with the second encoder's pad id."""
        if self._tokenizer_2 is None:
            if self.tokenizer_2_dir is not None:
                self._tokenizer_2 = _folder_tokenizer(Path(self.tokenizer_2_dir), self.spec.text2)
            else:
                self._tokenizer_2 = CLIPTokenizer.from_package(pad_token_id=self.spec.text2.pad_token_id)
        return self._tokenizer_2

    def tokenizer(self) -> CLIPTokenizer | WordPieceTokenizer:
        if self.spec.text is None:
            return self.tokenizer_2()
        if self._tokenizer is None:
            if self.tokenizer_dir is not None:
                self._tokenizer = _folder_tokenizer(Path(self.tokenizer_dir), self.spec.text)
            elif is_bert(self.spec.text):
                raise CheckpointError("a BERT text encoder needs its WordPiece vocabulary (tokenizer/vocab.txt), "
                                      "which this model lacks", self.path)
            else:
                self._tokenizer = CLIPTokenizer.from_package(pad_token_id=self.spec.text.pad_token_id)
        return self._tokenizer

    def load(self, component: str, dtype: torch.dtype = torch.float32, device="cpu") -> nn.Module:
        """Build one network (``text_encoder``, ``unet`` or ``vae``) with its weights in ``dtype`` on ``device``.

        Shapes are checked against the spec before any tensor is read; each tensor is converted straight
        from the file's storage into ``dtype`` (zero-copy when the file is memory-mapped and already in it).
        """
        return self.load_into(self.build_empty(component), component, dtype, device)

    def load_into(self, module: nn.Module, component: str, dtype: torch.dtype = torch.float32, device="cpu",
                  defer: frozenset[str] = frozenset()) -> nn.Module:
        """:meth:`load` into ``module``, a network from :meth:`build_empty`. Keys in ``defer`` are left on the meta
        device, for the caller to fill from :meth:`tensor` (prepacking converts those weights straight into their
        final layout)."""
        expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
        state = {}
        converted = 0
        for key in expected:
            if key in defer:
                state[key] = torch.empty(expected[key], device="meta")
                continue
            tensor = self.tensor(component, key)
            if isinstance(tensor, QuantizedTensor):   # a GGUF block format, dequantised here (see engine.lowbit)
                tensor = tensor.dequantize(dtype)
            target = dtype if tensor.is_floating_point() else tensor.dtype
            if tensor.dtype != target or torch.device(device).type != "cpu":
                converted += tensor.numel() * tensor.element_size()
            else:
                self._pinned.update(self.sources[component].files)  # this module's weights are views of the file
            state[key] = tensor.to(device=device, dtype=target)
            if converted > RELEASE_EVERY:
                self._release_pages()  # the converted copy is what stays; the file pages need not
                converted = 0
        self._release_pages()
        module.load_state_dict(state, strict=True, assign=True)
        return module.eval().requires_grad_(False)

    def tensor(self, component: str, key: str) -> torch.Tensor:
        """One tensor of a component under its canonical key, as stored (a view of the mapped file where it can
        be); a tensor that cannot be read is a :class:`CheckpointError` naming the file and the key."""
        source = self.sources[component]
        try:
            return source.view[key]
        except CheckpointError:
            raise
        except Exception as e:  # a corrupt tensor deep in a file: name it rather than show torch internals
            raise CheckpointError(f"cannot read the {component} tensor: {e}", source.files[0],
                                  source.file_key(key)) from None

    def build_empty(self, component: str) -> nn.Module:
        """The network with its weights on the meta device (no memory), after checking that the checkpoint has
        every key at the right shape."""
        if component not in COMPONENTS:
            raise ValueError(f"unknown component {component!r}: expected one of {', '.join(COMPONENTS)}")
        source = self.sources.get(component)
        if source is None:
            raise CheckpointError(f"the checkpoint has no {component.replace('_', ' ')}", self.path)
        with torch.device("meta"):
            module = build_network(component, self.spec)
        _check_keys(self.path, component, {k: tuple(v.shape) for k, v in module.state_dict().items()}, source)
        return module

    def use_vae(self, path: str | os.PathLike) -> None:
        """Take the VAE from the file ``path`` instead of the model's own (A1111's ``sd_vae``): an AutoencoderKL in
        the original layout (``encoder.down.0...``, bare or under ``first_stage_model.`` / ``vae.``) or diffusers'
        (``encoder.down_blocks.0...``, bare), in any format sdlite reads. Its keys and shapes must fit this model's
        VAE: a :class:`CheckpointError` names the file and the key otherwise."""
        store = open_checkpoint(path)
        try:
            keys = list(store.keys())
            prefix = next((p for p in ("", "first_stage_model.", "vae.") if f"{p}decoder.conv_in.weight" in keys),
                          None)
            if prefix is None:
                raise CheckpointError("not a VAE: no 'decoder.conv_in.weight' key (bare, or under "
                                      "'first_stage_model.' or 'vae.')", path)
            with torch.device("meta"):
                expected = {k: tuple(v.shape) for k, v in build_network("vae", self.spec).state_dict().items()}
            if prefix == "" and "decoder.up_blocks.0.resnets.0.conv1.weight" in keys:   # diffusers' names
                plan = normalize_diffusers_keys(keys, "vae", expected=expected)
            else:
                plan = vae_from_original(keys, prefix=prefix, expected=expected)
            source = ComponentSource.from_plan(plan, store, (str(path),))
            _check_keys(str(path), "vae", expected, source)
        except BaseException:
            store.close()
            raise
        self.sources["vae"] = source
        self._stores.append(store)

    def release_pages(self) -> None:
        """Hand the file pages read so far back to the kernel (they are re-read if needed again), except those of
        files that loaded weights are zero-copy views of, which must never lose a page written by a user."""
        self._release_pages()

    def _release_pages(self) -> None:
        for store in self._stores:
            if not self._pinned.intersection(map(str, store.paths)):
                store.release_pages()

    def problems(self) -> list[str]:
        """Everything unusual about the weights, from shapes only: missing keys, shape mismatches, keys that
        nothing uses. Loading fails on the first two kinds; ``sdlite info`` lists them all."""
        out = []
        for component in self.components:
            source = self.sources.get(component)
            if source is None:
                out.append(f"no {component.replace('_', ' ')} in the checkpoint")
                continue
            with torch.device("meta"):
                module = build_network(component, self.spec)
            expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
            out += [msg if key is None else f"{msg} (key {key!r})" for msg, key in
                    _key_problems(component, expected, source)]
            if source.unexpected:
                out.append(f"{len(source.unexpected)} unexpected {component} keys (ignored), first few: "
                           f"{_listing(source.unexpected)}")
        return out

    def parameter_counts(self) -> dict[str, int]:
        """Parameters per component, from shapes only."""
        counts = {}
        for name, source in self.sources.items():
            n = 0
            for shape in source.shapes.values():
                size = 1
                for d in shape:
                    size *= d
                n += size
            counts[name] = n
        return counts

    def close(self) -> None:
        for store in self._stores:
            store.close()
        self._stores.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass
class StableDiffusion:
    """A loaded model: tokenizer, the networks and the facts the sampler needs (SDXL: a second text encoder and
    its tokenizer; the SDXL refiner has only those, and ``text_encoder`` None)."""

    spec: ModelSpec
    tokenizer: CLIPTokenizer | WordPieceTokenizer
    text_encoder: CLIPTextEncoder | BertTextEncoder | None
    unet: UNet
    vae: AutoencoderKL | None   # None: a folder with only an AutoencoderTiny (Checkpoint.tiny_vae)
    scheduler_config: dict
    checkpoint: Checkpoint | None = None
    text_encoder_2: CLIPTextEncoder | None = None
    tokenizer_2: CLIPTokenizer | None = None

    def networks(self) -> dict[str, nn.Module]:
        return {name: getattr(self, name) for name in model_components(self.spec) if getattr(self, name) is not None}


def load_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32, device="cpu",
               prediction_type: str | None = None) -> StableDiffusion:
    """Open ``path`` and load all three networks into ``dtype`` on ``device``."""
    ckpt = open_model(path, prediction_type=prediction_type)
    unet = ckpt.load("unet", dtype, device)
    if ckpt.prediction_source == "unresolved":
        resolve_prediction_type(ckpt, unet, device)
    second = ckpt.spec.text2 is not None
    return StableDiffusion(spec=ckpt.spec, tokenizer=ckpt.tokenizer(),
                           text_encoder=ckpt.load("text_encoder", dtype, device) if ckpt.spec.text else None,
                           unet=unet, vae=ckpt.load("vae", dtype, device) if ckpt.has_vae else None,
                           scheduler_config=ckpt.scheduler_config,
                           checkpoint=ckpt, text_encoder_2=ckpt.load("text_encoder_2", dtype, device) if second else None,
                           tokenizer_2=ckpt.tokenizer_2() if second else None)


def open_model(path: str | os.PathLike, prediction_type: str | None = None, use_ema: bool = False,
               text_encoders=()) -> Checkpoint:
    """Identify ``path`` (a diffusers folder or a single file) without reading any tensor data.

    ``prediction_type`` overrides what the checkpoint says (``epsilon`` or ``v_prediction``). ``text_encoders``:
    files of the text encoders a single file lacks (SD3: ComfyUI's ``clip_l``, ``clip_g``, ``t5xxl`` files; see
    :mod:`sdlite.weights.sd3`).
    """
    if prediction_type is not None and prediction_type not in PREDICTION_TYPES:
        raise ConfigError(f"prediction type {prediction_type!r} is not valid: expected one of "
                          f"{', '.join(PREDICTION_TYPES)}")
    path = Path(path)
    if not path.exists():
        raise CheckpointError("no such file or folder", path)
    try:
        if text_encoders and path.is_dir():
            raise CheckpointError("separate text-encoder files go with a single-file model; a diffusers folder "
                                  "holds its own", path)
        ckpt = _open_diffusers_folder(path) if path.is_dir() else \
            _open_single_file(path, use_ema=use_ema, text_encoders=text_encoders)
    except CheckpointError as e:
        if e.path is None:  # errors from the key tables and detection know keys, not files
            e.path = str(path)
        raise
    if prediction_type is not None:
        if ckpt.spec.transformer is not None:
            raise ConfigError(f"prediction type {prediction_type!r}: an SD3 or FLUX model is flow matching, always")
        _set_prediction(ckpt, prediction_type, "given by the user")
    return ckpt


# --- diffusers folders --------------------------------------------------------------------------------------


def _open_diffusers_folder(folder: Path) -> Checkpoint:
    index_file = folder / "model_index.json"
    if not index_file.is_file():
        raise CheckpointError("not a diffusers folder (model_index.json is missing) and not a checkpoint file",
                              folder)
    index = _read_json(index_file)
    cls = index.get("_class_name", "")
    if cls in SDXL_PIPELINES:
        return _open_sdxl_folder(folder, index, index_file)
    opener = _FOLDER_OPENERS.get(cls)   # the families whose folders have openers of their own
    if opener is not None:
        return Checkpoint(**opener(folder, index, index_file))
    if cls and cls not in SD_PIPELINES + X4_PIPELINES:
        raise CheckpointError(f"pipeline class {cls!r} is not a pipeline sdlite runs (Stable Diffusion 1.x/2.x: "
                              f"{', '.join(SD_PIPELINES)}; SDXL: {', '.join(SDXL_PIPELINES)}; SD3: "
                              f"{', '.join(SD3_PIPELINES)}; FLUX.1: {', '.join(FLUX_PIPELINES)}; Z-Image: {', '.join(ZIMAGE_PIPELINES)}; FLUX.2 [klein]: {', '.join(FLUX2_PIPELINES[:-1])}; Qwen-Image: {', '.join(QWENIMAGE_PIPELINES)}; the x4 upscaler: {', '.join(X4_PIPELINES)})", index_file)
    where = _component_folders(folder, index, index_file)
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    configs: dict[str, dict] = {}
    try:
        configs["text_encoder"] = _read_json(where["text_encoder"] / "config.json")
        architecture = _text_architecture(configs["text_encoder"], where["text_encoder"] / "config.json")
        where["vae"], tiny_vae = _vae_folders(where["vae"])   # an SDXS folder: the AutoencoderKL is in vae_large/
        for component in ("text_encoder", "unet", "vae"):
            if where[component] is None:
                continue
            if component != "text_encoder":
                configs[component] = _read_json(where[component] / "config.json")
            store = _component_store(folder, component, where[component])
            stores.append(store)
            if component == "text_encoder" and architecture == "bert":
                plan = normalize_bert_keys(list(store.keys()))
            else:
                plan = normalize_diffusers_keys(list(store.keys()), component)
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        # a BERT text tower is checked against its own config below; detection reads the CLIP and SD parts
        detected = {name: src.shapes for name, src in sources.items()
                    if not (name == "text_encoder" and architecture == "bert")}
        detection = detect(detected)
        tokenizer_dir = where["tokenizer"]
        pad, folder_tokenizer = None, None
        try:
            if architecture == "bert":
                text = BertTextConfig.from_diffusers(configs["text_encoder"])
            else:
                text = TextEncoderConfig.from_diffusers(configs["text_encoder"])
            unet = UNetConfig.from_diffusers(configs["unet"])
            vae = VAEConfig.from_diffusers(configs["vae"]) if "vae" in configs else None
        except (ConfigError, KeyError, TypeError) as e:
            raise CheckpointError(f"unusable component config: {e}", folder) from None
        if tokenizer_kind(tokenizer_dir) is not None:
            folder_tokenizer = _folder_tokenizer(tokenizer_dir, text)  # kept by the Checkpoint: built once
            pad = folder_tokenizer.pad_token_id
        else:
            tokenizer_dir = None
        if architecture == "bert":
            if text.width != unet.context_dim:
                raise CheckpointError(f"the BERT text encoder's width {text.width} (text_encoder/config.json "
                                      f"hidden_size) does not match the UNet's cross-attention context dim "
                                      f"{unet.context_dim}", folder)
            if pad is not None:
                text = dataclasses.replace(text, pad_token_id=pad)
        elif tokenizer_dir is None:   # OpenCLIP towers (SD 2.x, the x4 upscaler) pad with "!", CLIP-L with the end
            openclip = detection.base_family == "sd2" or detection.family == X4_FAMILY
            text = dataclasses.replace(text, pad_token_id=SD2_PAD_TOKEN_ID if openclip else SD1_PAD_TOKEN_ID)
        else:
            text = dataclasses.replace(text, pad_token_id=pad)
        sched_file = where["scheduler"] / "scheduler_config.json"
        scheduler = _read_json(sched_file) if sched_file.is_file() else {}
        prediction = scheduler.get("prediction_type", "epsilon")
        if prediction not in PREDICTION_TYPES:
            raise CheckpointError(f"prediction_type {prediction!r} is not supported", sched_file)
        base = _family_preset(detection.family, prediction)
        sched_cfg, sched_source = _folder_scheduler(sched_file, scheduler, detection.family, prediction)
        x4_parts, notes = {}, []
        if tiny_vae is not None:
            vae, note = _tiny_vae_parts(tiny_vae, vae, base.vae)
            notes.append(note)
        if (detection.family == X4_FAMILY) != (cls in X4_PIPELINES) and cls:
            what = "an x4 upscaler's" if detection.family == X4_FAMILY else f"a {detection.family} one"
            raise CheckpointError(f"model_index.json names {cls} but the UNet is {what}", index_file)
        if detection.family == X4_FAMILY:
            x4_parts, notes = _x4_folder_parts(folder, index, index_file, vae, configs.get("vae", {}))
            vae = x4_parts.pop("vae")
        spec = base.replace(family=detection.family, text=text, unet=unet, vae=vae, prediction_type=prediction,
                            scheduler=sched_cfg, default_size=unet.sample_size * vae.downscale,
                            turbo=_says_turbo(index, scheduler), **x4_parts)
    except BaseException:
        for store in stores:
            store.close()
        raise
    if index.get(SHARED_FROM_KEY) is not None:
        own = [p for p in ("text_encoder", "tokenizer", "unet", "vae", "scheduler") if (folder / p).is_dir()]
        notes.append(f"holds {', '.join(own)}; the other parts are shared from {index[SHARED_FROM_KEY]!r}")
    return Checkpoint(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                      storage_dtype=_storage_dtype(stores[1]), tiny_vae=str(tiny_vae) if tiny_vae else None,
                      prediction_source="scheduler_config.json" if "prediction_type" in scheduler
                      else "family default",
                      sources=sources, scheduler_config=dict(spec.scheduler), scheduler_source=sched_source,
                      tokenizer_dir=str(tokenizer_dir) if tokenizer_dir else None,
                      notes=notes, _stores=stores, _tokenizer=folder_tokenizer)  # the folder's config.json files settle what detection guesses


def _tiny_vae_parts(tiny: Path, vae: VAEConfig | None, preset: VAEConfig) -> tuple[VAEConfig, str]:
    """A folder whose vae/ is an AutoencoderTiny (``tiny``): the VAEConfig of its latent space (``vae``, from
    vae_large/, or the family's for a folder without one) and the note that says which decoder is used."""
    config_file = tiny / "config.json"
    latent = _read_json(config_file).get("latent_channels", 4)
    if vae is None:
        vae = dataclasses.replace(preset, latent_channels=latent)
    if latent != vae.latent_channels:
        raise CheckpointError(f"the AutoencoderTiny has {latent} latent channels, the AutoencoderKL in {LARGE_VAE}/ "
                              f"{vae.latent_channels}", config_file)
    if tiny.parent.joinpath(LARGE_VAE).is_dir():
        return vae, (f"vae/ is an AutoencoderTiny (TAESD): it decodes the images, as diffusers' pipeline does with "
                     f"this folder; the AutoencoderKL in {LARGE_VAE}/ encodes image-to-image sources and decodes "
                     "with --vae-decoder vae")
    return vae, (f"vae/ is an AutoencoderTiny (TAESD) and there is no {LARGE_VAE}/: it decodes the images and "
                 "encodes image-to-image sources (its own encoder, as diffusers does), and there is no full VAE")


def _open_sdxl_folder(folder: Path, index: dict, index_file: Path) -> Checkpoint:
    """An SDXL pipeline folder (base, refiner, Turbo): ``text_encoder`` (CLIP ViT-L, absent from the refiner) and
    ``text_encoder_2`` (OpenCLIP bigG with its projection) with their tokenizers, the UNet, the VAE, the scheduler;
    ``force_zeros_for_empty_prompt`` and ``requires_aesthetics_score`` from model_index.json (the defaults of
    diffusers' SDXL pipelines where it does not say)."""
    cls = index.get("_class_name")
    # a component the pipeline does not have is [null, null] in model_index.json (the refiner's text_encoder)
    present = {name for name in ("text_encoder", "text_encoder_2", "unet", "vae", "tokenizer", "tokenizer_2")
               if (folder / name).is_dir() and index.get(name, ["", ""]) != [None, None]}
    for needed in ("text_encoder_2", "unet", "vae", "tokenizer_2"):
        if needed not in present:
            raise CheckpointError(f"the {cls} folder has no {needed}", folder)
    if ("text_encoder" in present) != ("tokenizer" in present):
        raise CheckpointError("the folder has " + ("text_encoder but no tokenizer" if "text_encoder" in present
                                                   else "tokenizer but no text_encoder"), folder)
    if _vae_folders(folder / "vae")[1] is not None:
        raise CheckpointError(f"vae/ is an AutoencoderTiny: sdlite reads those as the default decoder of SD 1.x/2.x "
                              f"folders (SDXS); for a {cls} folder, put the AutoencoderKL in vae/ and pass the tiny "
                              "one with --vae-decoder", folder / "vae" / "config.json")
    stores: list[TensorStore] = []
    sources: dict[str, ComponentSource] = {}
    try:
        configs = {}
        for component in ("text_encoder", "text_encoder_2", "unet", "vae"):
            if component not in present:
                continue
            configs[component] = _read_json(folder / component / "config.json")
            store = _component_store(folder, component)
            stores.append(store)
            plan = normalize_diffusers_keys(list(store.keys()), "text_encoder" if component.startswith("text")
                                            else component)
            sources[component] = ComponentSource.from_plan(plan, store, tuple(store.paths))
        for component in ("text_encoder", "text_encoder_2"):
            if component in configs and _text_architecture(configs[component],
                                                            folder / component / "config.json") != "clip":
                raise CheckpointError("SDXL's text encoders are CLIP text towers", folder / component / "config.json")
        try:
            unet = UNetConfig.from_diffusers(configs["unet"])
            vae = VAEConfig.from_diffusers(configs["vae"])
            tokenizers = {}
            texts = {}
            for component, tok in (("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")):
                if component in configs:
                    text = TextEncoderConfig.from_diffusers(configs[component])
                    tokenizers[component] = _folder_tokenizer(folder / tok, text)
                    texts[component] = dataclasses.replace(text, pad_token_id=tokenizers[component].pad_token_id)
        except (ConfigError, KeyError, TypeError) as e:
            raise CheckpointError(f"unusable component config: {e}", folder) from None
        if unet.addition_embed != "text_time":
            raise CheckpointError(f"the UNet of a {cls} folder has no text_time added conditioning "
                                  "(unet/config.json addition_embed_type)", folder / "unet" / "config.json")
        width = sum(t.width for t in texts.values())
        if width != unet.context_dim:
            raise CheckpointError(f"the text encoders' widths ({' + '.join(str(t.width) for t in texts.values())}) do "
                                  f"not make the UNet's cross-attention context dim {unet.context_dim}", folder)
        aesthetics = bool(index.get("requires_aesthetics_score", False))
        family = "sdxl-refiner" if aesthetics or "text_encoder" not in texts else "sdxl"
        base = PRESETS[family]
        sched_file = folder / "scheduler" / "scheduler_config.json"
        scheduler = _read_json(sched_file) if sched_file.is_file() else {}
        prediction = scheduler.get("prediction_type", "epsilon")
        if prediction not in PREDICTION_TYPES:
            raise CheckpointError(f"prediction_type {prediction!r} is not supported", sched_file)
        turbo = _says_turbo(index, scheduler)
        sched_cfg, sched_source = _folder_scheduler(sched_file, scheduler, "sdxl-turbo" if turbo else family,
                                                    prediction)
        spec = base.replace(text=texts.get("text_encoder"), text2=texts["text_encoder_2"], unet=unet, vae=vae,
                            prediction_type=prediction, scheduler=sched_cfg,
                            default_size=unet.sample_size * vae.downscale,
                            force_zeros_for_empty_prompt=bool(index.get("force_zeros_for_empty_prompt",
                                                                        not aesthetics)),
                            requires_aesthetics_score=aesthetics, turbo=turbo)
        if unet.add_embed_in != texts["text_encoder_2"].projection_dim + \
                (5 if aesthetics else 6) * unet.addition_time_embed_dim:
            raise CheckpointError(
                f"the UNet's added-conditioning input width {unet.add_embed_in} (projection_class_embeddings_input_dim) "
                f"is not the pooled text embedding ({texts['text_encoder_2'].projection_dim}) plus "
                f"{5 if aesthetics else 6} time ids of {unet.addition_time_embed_dim} "
                f"(requires_aesthetics_score={aesthetics} in model_index.json)", folder / "unet" / "config.json")
        detection = Detection(layout="diffusers", family=family, components=model_components(spec), unet=None)
    except BaseException:
        for store in stores:
            store.close()
        raise
    return Checkpoint(path=str(folder), layout="diffusers", spec=spec, detection=detection,
                      storage_dtype=_storage_dtype(stores[[*sources].index("unet")]),
                      prediction_source="scheduler_config.json" if "prediction_type" in scheduler
                      else "family default",
                      sources=sources, scheduler_config=dict(spec.scheduler), scheduler_source=sched_source,
                      tokenizer_dir=str(folder / "tokenizer") if "text_encoder" in texts else None,
                      tokenizer_2_dir=str(folder / "tokenizer_2"), _stores=stores,
                      _tokenizer=tokenizers.get("text_encoder"), _tokenizer_2=tokenizers["text_encoder_2"])


def _x4_folder_parts(folder: Path, index: dict, index_file: Path, vae: VAEConfig,
                     vae_config: dict) -> tuple[dict, list[str]]:
    """An x4 upscaler folder's own parts: ``{"low_res_scheduler", "max_noise_level", "vae"}`` for its ModelSpec, and
    notes. The low-resolution image's DDPM schedule comes from ``low_res_scheduler/scheduler_config.json`` (completed
    by the published one, which a folder without it gets whole), the highest noise level from model_index.json
    (diffusers' default 350 where it does not say). The VAE's latents are scaled by 0.08333 whatever its config says,
    as diffusers' StableDiffusionUpscalePipeline enforces."""
    from .sampling.schedules import NoiseSchedule, ScheduleError

    notes = []
    low_file = folder / "low_res_scheduler" / "scheduler_config.json"
    low = dict(X4_LOW_RES_SCHEDULER)
    if low_file.is_file():
        low.update({k: v for k, v in _read_json(low_file).items() if k != "_diffusers_version"})
    else:
        notes.append("no low_res_scheduler/scheduler_config.json: the low-resolution image is noised by the schedule "
                      "published with stabilityai/stable-diffusion-x4-upscaler")
        low_file = index_file
    try:
        n_train = NoiseSchedule.from_config(low).num_train_timesteps
    except ScheduleError as e:
        raise CheckpointError(f"unusable low-resolution noise schedule: {e}", low_file) from None
    level = index.get("max_noise_level", X4_MAX_NOISE_LEVEL)
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < n_train:
        raise CheckpointError(f"max_noise_level {level!r} is not valid: expected an integer from 0 to {n_train - 1} "
                              "(the low-resolution schedule's timesteps)", index_file)
    if vae.scaling_factor != X4_SCALING_FACTOR:
        stated = vae_config.get("scaling_factor")
        notes.append(f"vae/config.json {'has no scaling_factor' if stated is None else f'says scaling_factor {stated}'}"
                     f": the x4 upscaler's latents are scaled by {X4_SCALING_FACTOR}, as diffusers enforces")
        vae = dataclasses.replace(vae, scaling_factor=X4_SCALING_FACTOR)
    return {"low_res_scheduler": low, "max_noise_level": level, "vae": vae}, notes


def _folder_scheduler(sched_file: Path, scheduler: dict, family: str, prediction: str) -> tuple[dict, str]:
    """A folder's scheduler config (``scheduler``, read from ``sched_file``; empty when there is none) completed by
    the one published for ``family``, the timestep spacing made explicit, and a line saying where it came from."""
    repo, published = published_scheduler(family, prediction)
    if sched_file.is_file():  # what the folder does not say, the family's published config does
        cfg, spacing_note = explicit_spacing({**published, **{k: v for k, v in scheduler.items()
                                                              if k != "_diffusers_version"}})
        return cfg, f"scheduler/scheduler_config.json (timestep spacing {spacing_note})"
    cfg, spacing_note = explicit_spacing(published)
    return cfg, (f"no scheduler/scheduler_config.json: the config published with {repo} (timestep spacing "
                 f"{spacing_note})")


def _says_turbo(index: dict, scheduler: dict) -> bool:
    """A distilled Turbo model, as its folder shows it: the name it was saved under (``_name_or_path``), or the
    scheduler the Turbo repositories publish (trailing spacing, which no base model uses)."""
    name = str(index.get("_name_or_path", "")).lower()
    return "turbo" in name or scheduler.get("timestep_spacing") == "trailing"


# --- single files ---------------------------------------------------------------------------------------------


def _open_single_file(path: Path, use_ema: bool, text_encoders=()) -> Checkpoint:
    store = open_checkpoint(path)
    if is_sd3_file(store.keys()):
        return Checkpoint(**open_sd3_file(path, store, text_encoders))
    if is_flux2_file(store.keys()):   # before FLUX.1, whose block names FLUX.2 shares
        return Checkpoint(**open_flux2_file(path, store, text_encoders))
    if is_flux_file(store.keys()):
        return Checkpoint(**open_flux_file(path, store, text_encoders))
    if is_zimage_file(store.keys()):
        return Checkpoint(**open_zimage_file(path, store, text_encoders))
    if is_qwenimage_file(store.keys()):
        return Checkpoint(**open_qwenimage_file(path, store, text_encoders))
    if text_encoders:
        store.close()
        raise CheckpointError("separate text-encoder files (--text-encoder) go with SD3, FLUX, Z-Image and Qwen-Image "
                              "models; this file is not one", path)
    try:
        shapes = _shapes(store)
        detection = detect(shapes, store.metadata)
        base = _family_preset(detection.family, detection.prediction_type or "epsilon", turbo=detection.turbo)
        if META_CONFIG in store.metadata:
            configs = _configs_from_metadata(path, store.metadata[META_CONFIG])
        else:
            configs = _configs_from_detection(path, detection, base)
        spec = base.replace(family=detection.family, **configs)
        spec, sched_source = _with_published_scheduler(spec)
        expected = {}
        for component in detection.components:
            with torch.device("meta"):
                module = build_network(component, spec)
            expected[component] = list(module.state_dict())
        plan = plan_from_original(list(store.keys()), unet_structure=spec.unet, use_ema=use_ema,
                                  text_encoder_layers=spec.text.layers if spec.text is not None else None,
                                  expected=expected)
        sources = {}
        for component, cplan in plan.components.items():
            sources[component] = ComponentSource.from_plan(cplan, store, (str(path),))
        notes = list(detection.notes) + list(plan.notes)
        if plan.unexpected:
            notes.append(f"{len(plan.unexpected)} keys outside the known components, first few: "
                         f"{_listing(plan.unexpected)}")
    except BaseException:
        store.close()
        raise
    ckpt = Checkpoint(path=str(path), layout="original", spec=spec, detection=detection,
                      storage_dtype=_storage_dtype(store, prefix=detection.prefixes.get("unet", "")),
                      prediction_source="unresolved", sources=sources, scheduler_config=dict(spec.scheduler),
                      scheduler_source=sched_source, notes=notes, _stores=[store])
    if detection.prediction_type is not None:
        _set_prediction(ckpt, detection.prediction_type, detection.prediction_source or "file metadata")
    else:
        yaml_prediction = _prediction_from_yaml(path)
        if yaml_prediction is not None:
            _set_prediction(ckpt, *yaml_prediction)
        elif detection.base_family == "sd1":
            _set_prediction(ckpt, "epsilon", "family default (SD 1.x is always epsilon)")
        elif detection.base_family == "sdxl":  # the UNet probe below cannot run without SDXL's added conditioning
            _set_prediction(ckpt, "epsilon", "family default (SDXL is epsilon unless the file says otherwise)")
        elif detection.family == X4_FAMILY:   # nor without the x4 upscaler's image and noise level
            _set_prediction(ckpt, "v_prediction", "family default (the x4 upscaler is v-prediction: parameterization "
                                                  "v in its x4-upscaling.yaml)")
    return ckpt


def _configs_from_detection(path: Path, detection: Detection, base: ModelSpec) -> dict:
    """``ModelSpec`` fields (``text``, ``text2``, ``unet``, ``vae``) implied by the shapes; what shapes cannot show
    (head counts, token ids) follows the family convention of ``base``."""
    try:
        kwargs = detection.unet.config_kwargs()
        kwargs.setdefault("heads", _family_heads(detection.base_family, kwargs["block_channels"]))
        out = {"unet": dataclasses.replace(base.unet, **kwargs), "vae": base.vae}
        if detection.vae is not None:
            out["vae"] = dataclasses.replace(base.vae, **detection.vae.config_kwargs())
        for field_name, info in (("text", detection.text_encoder), ("text2", detection.text_encoder_2)):
            if info is None:
                continue
            kwargs = {k: v for k, v in info.config_kwargs().items() if v is not None}
            if "heads" not in kwargs:  # not a multiple of the standard 64-wide heads: shapes cannot tell
                kwargs["heads"] = 1
            out[field_name] = dataclasses.replace(getattr(base, field_name) or TextEncoderConfig(), **kwargs)
    except ConfigError as e:
        raise CheckpointError(f"the shapes do not form a {detection.family} model: {e}", path) from None
    return out


def _configs_from_metadata(path: Path, raw: str) -> dict:
    """``ModelSpec`` fields from the configs a file written by sdlite carries (an SDXL refiner's has no
    ``text_encoder``: its ``text`` is None)."""
    try:
        data = json.loads(raw)
        out = {"unet": UNetConfig.from_diffusers(data["unet"]), "vae": VAEConfig.from_diffusers(data["vae"])}
        if "text_encoder_2" in data:
            out["text2"] = TextEncoderConfig.from_diffusers(data["text_encoder_2"])
            out["text"] = TextEncoderConfig.from_diffusers(data["text_encoder"]) if "text_encoder" in data else None
        else:
            out["text"] = TextEncoderConfig.from_diffusers(data["text_encoder"])
        return out
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"metadata {META_CONFIG!r} is not a usable config ({e})", path) from None


def _prediction_from_yaml(path: Path) -> tuple[str, str] | None:
    """The original config file people keep beside a single file (``model.yaml`` for ``model.ckpt``)."""
    for yaml_path in (path.with_suffix(".yaml"), path.with_suffix(".yml")):
        if yaml_path.is_file():
            text = yaml_path.read_text(encoding="utf-8", errors="replace")
            m = re.search(r"^\s*parameterization:\s*[\"']?(\w+)", text, re.MULTILINE)
            value = m.group(1) if m else "eps"
            return ("v_prediction" if value == "v" else "epsilon"), f"{yaml_path.name} (parameterization: {value})"
    return None


def resolve_prediction_type(ckpt: Checkpoint, unet: UNet | None = None, device="cpu") -> str:
    """Decide eps vs v for a SD 2.x single file that does not say, by probing its UNet as A1111 does.

    The probe feeds a constant latent (0.5) at t=999 with a constant context: a v-prediction UNet's output
    minus its input averages below -1 there, an eps UNet's does not.
    """
    if ckpt.prediction_source != "unresolved":
        return ckpt.spec.prediction_type
    if unet is None or unet.dtype != torch.float32:
        unet, device = ckpt.load("unet", torch.float32), "cpu"
    with torch.no_grad():
        x = torch.full((1, unet.config.in_channels, 8, 8), 0.5, device=device)
        ctx = torch.full((1, 2, unet.config.context_dim), 0.5, device=device)
        score = (unet(x, torch.tensor([999.0], device=device), ctx) - x).mean().item()
    prediction = "v_prediction" if score < -1 else "epsilon"
    _set_prediction(ckpt, prediction, f"probed from the UNet (mean output - input at t=999: {score:.3f})")
    return prediction


def _set_prediction(ckpt: Checkpoint, prediction: str, source: str) -> None:
    ckpt.spec = ckpt.spec.replace(prediction_type=prediction)
    if ckpt.layout == "original":
        if ckpt.detection.base_family == "sd2":
            ckpt.spec = ckpt.spec.replace(default_size=768 if prediction == "v_prediction" else 512)
        # SD 2.x base and v models publish different scheduler configs (same schedule values)
        ckpt.spec, ckpt.scheduler_source = _with_published_scheduler(ckpt.spec)
        ckpt.scheduler_config = dict(ckpt.spec.scheduler)
    ckpt.scheduler_config["prediction_type"] = prediction
    ckpt.prediction_source = source


# the published configs of the Turbo models, by the family they were distilled from
_TURBO_SCHEDULERS = {"sdxl": "sdxl-turbo", "sd2": "sd-turbo"}


def _with_published_scheduler(spec: ModelSpec) -> tuple[ModelSpec, str]:
    """A single file's spec with its family's published scheduler config (a Turbo model's: its own), and a line
    saying so."""
    key = _TURBO_SCHEDULERS.get(spec.family, spec.family) if spec.turbo else spec.family
    repo, cfg = published_scheduler(key, spec.prediction_type)
    cfg, spacing_note = explicit_spacing(cfg)
    return (spec.replace(scheduler=cfg),
            f"the file carries none: the config published with {repo} (timestep spacing {spacing_note})")


# --- helpers --------------------------------------------------------------------------------------------------


def _shapes(store: TensorStore) -> dict[str, tuple[int, ...]]:
    return {k: tuple(store.shape(k)) for k in store.keys()}


def _family_preset(family: str, prediction: str, turbo: bool = False) -> ModelSpec:
    """The preset whose conventions a model of ``family`` follows where its weights do not tell (``turbo``: the
    distilled SDXL-Turbo / SD-Turbo)."""
    if family in ("sdxl", "sdxl-refiner"):
        preset = PRESETS["sdxl-turbo" if turbo and family == "sdxl" else family]
    elif family == X4_FAMILY:
        preset = PRESETS[X4_FAMILY]
    elif family.startswith("sd2"):
        if turbo and family == "sd2" and prediction == "epsilon":
            preset = PRESETS["sd-turbo"]
        else:
            preset = PRESETS["sd21-v"] if prediction == "v_prediction" else PRESETS["sd21-base"]
    else:
        preset = PRESETS["sd15"]
    return preset.replace(family=family)


def _family_heads(base_family: str, channels: tuple[int, ...]) -> tuple[int, ...]:
    if base_family in ("sd2", "sdxl"):
        return tuple(max(c // 64, 1) for c in channels)
    return tuple(8 for _ in channels)


def _key_problems(component: str, expected: dict, source: ComponentSource) -> list[tuple[str, str | None]]:
    """(message, key) for every missing key (one summary) and every shape mismatch, without reading tensors."""
    problems: list[tuple[str, str | None]] = []
    missing = [k for k in expected if k not in source.shapes]
    if missing:
        problems.append((f"{len(missing)} {component} keys are missing, first few: {_listing(missing)}", None))
    for key, shape in expected.items():
        got = source.shapes.get(key)
        if got is not None and tuple(got) != shape:
            problems.append((f"the {component} tensor has shape {list(got)} but the detected model needs "
                             f"{list(shape)}", source.file_key(key)))
    return problems


def _check_keys(path: str, component: str, expected: dict, source: ComponentSource) -> None:
    """Missing keys and shape mismatches are errors that name the file, the key and both shapes."""
    problems = _key_problems(component, expected, source)
    if problems:
        message, key = problems[0]
        raise CheckpointError(message, source.files[0] if len(source.files) == 1 else path, key)
