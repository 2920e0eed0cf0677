"""ComfyUI's separate-file loaders on sdlite: UNETLoader, CLIPLoader, DualCLIPLoader, TripleCLIPLoader and VAELoader,
and city96's GGUF loaders (UnetLoaderGGUF, CLIPLoaderGGUF, DualCLIPLoaderGGUF, TripleCLIPLoaderGGUF), the way
ComfyUI users run FLUX.1, SD3.5 and Z-Image (its transformer by UNETLoader, its Qwen3-4B by CLIPLoader of type
``lumina2``, as ComfyUI's stock Z-Image workflow loads them; the nodes of that workflow the others lack are
:mod:`.zimage`'s).

Their files come from ComfyUI's folders under the server's ``--models-dir``: ``diffusion_models`` (and the older
``unet``), ``text_encoders`` (and ``clip``), ``vae`` (and ``--vae-dir``). What they output are references
(:class:`~.nodes.ModelRef`, :class:`~.nodes.ClipRef`, :class:`~.nodes.VaeRef` naming the files and
the node that gave them); sdlite loads a whole model into one engine, so when a node needs a network the
combination of files becomes one engine of the server's engine cache (:meth:`Engines.get
<sdlite.server.checkpoints.Engines.get>` keyed by the transformer file, the text-encoder files and the VAE file):
the sampler's engine is its model's file with the text encoders of its conditioning's CLIP and the VAE the prompt
decodes with (when every VAE input of the prompt comes from VAELoaders naming one file, and the prompt loads one
model), so a VAEDecode after it finds the same engine, and a queued-again prompt loads nothing.

UNETLoader's fp8 ``weight_dtype`` (``fp8_e4m3fn``, ``fp8_e5m2``) is honoured for FLUX.1, SD3, Z-Image and Qwen-Image
(Qwen-Image-Edit too) transformer files as ComfyUI stores the model: every Linear weight of the transformer cast to
that fp8 type as it loads (torch's rounding) and kept so in memory, one byte a weight, converted exactly into the
engine's compute dtype layer by layer as it runs (:mod:`sdlite.engine.lowbit`). ComfyUI casts the biases, norms and
embeddings too; sdlite keeps those (under 0.1 % of the bytes) in the compute dtype. ComfyUI on a CPU computes in fp32;
sdlite in its engine's precision (bf16 on CPUs with native bf16). ``fp8_e4m3fn_fast`` (fp8 matrix products on GPUs
that have them, in ComfyUI) is the same storage as ``fp8_e4m3fn`` here, on every device. The storage is part of the
engine's key: a default engine and an fp8 one of the same file are two engines.

Refused at validation: text-encoder types other than SD3's, FLUX's, Z-Image's (``lumina2``), FLUX.2 [klein]'s
(``flux2``) and Qwen-Image's (``qwen_image``: Qwen-Image and Qwen-Image-Edit; sdlite takes separate text-encoder files
for those families only), a file that is not what its input takes (a VAE given as a text encoder, a FLUX pair without
T5 or CLIP, a CLIP-G for FLUX, anything but a Qwen LLM for ``lumina2``, ``flux2`` and ``qwen_image``, a Qwen LLM for
the others), a file that is not a VAE for VAELoader, an fp8 ``weight_dtype`` for a file that is no FLUX, SD3, Z-Image
or Qwen-Image transformer (a UNet's weights stay in the engine's precision) or on a server in memory mode 0 or under
``--precision int8`` / ``int4``. At run time a combination that does not make a model (a FLUX VAE for an SD 1.5
checkpoint, CLIP widths that are not the transformer's) is an error naming the nodes, inputs and files.
"""
from __future__ import annotations

from pathlib import Path

from ...errors import CheckpointError
from ..checkpoints import Checkpoint
from .nodes import COMBO, ClipRef, Input, Lists, ModelRef, Refused, VaeRef, node

MODEL_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin")
FOLDERS = {"diffusion_models": ("diffusion_models", "unet"), "text_encoders": ("text_encoders", "clip"),
           "vae": ("vae",)}
# ComfyUI's type lists; sdlite takes separate text-encoder files for the TAKEN_TYPES only
CLIP_TYPES = ("stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
              "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "flux2")
DUAL_CLIP_TYPES = ("sdxl", "sd3", "flux", "hunyuan_video", "hidream")
WEIGHT_DTYPES = ("default", "fp8_e4m3fn", "fp8_e4m3fn_fast", "fp8_e5m2")
TAKEN_TYPES = ("sd3", "flux", "lumina2", "flux2", "qwen_image")   # lumina2: Z-Image's Qwen3-4B (ComfyUI's Lumina 2
QWEN_TYPES = ("lumina2", "flux2", "qwen_image")   # Gemma is no sdlite model); flux2: FLUX.2 [klein]'s Qwen3-4B / 8B;
# qwen_image: Qwen-Image's and Qwen-Image-Edit's Qwen2.5-VL-7B (its vision tower under visual. read by the edit models)


# --- the folders ---------------------------------------------------------------------------------------------

def folder_files(server, kind: str, suffixes: tuple[str, ...]) -> dict[str, Path]:
    """The files of ComfyUI's ``kind`` folder(s) under ``--models-dir`` (``vae`` also ``--vae-dir``), by their path
    relative to their folder; a name in an earlier folder hides the same name in a later one."""
    models_dir = getattr(server.checkpoints, "models_dir", None)
    roots = [models_dir / sub for sub in FOLDERS[kind]] if models_dir is not None else []
    if kind == "vae" and getattr(server, "vae_dir", None) is not None:
        roots.append(Path(server.vae_dir))
    found: dict[str, Path] = {}
    for root in roots:
        if root.is_dir():
            for path in sorted(root.rglob("*")):
                if path.is_file() and path.suffix.lower() in suffixes:
                    found.setdefault(path.relative_to(root).as_posix(), path)
    return found


def _listed(kind: str, suffixes: tuple[str, ...]):
    def files(lists: Lists) -> dict[str, Path]:
        return lists._get(f"{kind}{suffixes}", lambda: folder_files(lists.server, kind, suffixes))
    return files


unets = _listed("diffusion_models", MODEL_SUFFIXES)
gguf_unets = _listed("diffusion_models", (".gguf",))
text_encoders = _listed("text_encoders", MODEL_SUFFIXES)
gguf_text_encoders = _listed("text_encoders", (*MODEL_SUFFIXES, ".gguf"))   # city96's lists both
vaes = _listed("vae", MODEL_SUFFIXES)


def _names(files) -> Input:
    return COMBO(lambda lists: list(files(lists)))


# --- what a file holds -----------------------------------------------------------------------------------------

def file_kind(path: Path) -> str:
    """What a separate file holds, read from its keys: "T5", "CLIP-L" (768 wide), "CLIP-G" (1280), "CLIP" (another
    width), "Qwen" (a Qwen LLM decoder: Z-Image's Qwen3-4B), "LLM" (a decoder of the same names without Qwen's q/k norms
    or q/k/v biases: Lumina 2's Gemma, a Llama), "VAE", or "unknown"."""
    from ...weights.io import open_checkpoint
    from ...weights.qwen_keys import find_qwen_prefix
    from ...weights.qwenimage_vae_keys import is_qwenimage_vae
    from ...weights.t5_keys import find_t5_prefix

    with open_checkpoint(path) as store:
        keys = list(store.keys())
        if find_t5_prefix(keys) is not None:
            return "T5"
        embed = next((k for k in keys if k.endswith("embeddings.token_embedding.weight")), None)
        if embed is not None:
            return {768: "CLIP-L", 1280: "CLIP-G"}.get(tuple(store.shape(embed))[1], "CLIP")
        prefix = find_qwen_prefix(keys)
        if prefix is not None:
            marks = ("layers.0.self_attn.q_norm.weight", "layers.0.self_attn.q_proj.bias", "blk.0.attn_q_norm.weight",
                     "blk.0.attn_q.bias")
            return "Qwen" if any(prefix + mark in keys for mark in marks) else "LLM"
        if any(k.endswith("decoder.conv_in.weight") for k in keys) or is_qwenimage_vae(keys):
            return "VAE"   # an LDM / diffusers VAE, or Qwen-Image's (Wan 2.1's causal VAE, in either layout)
    return "unknown"


def _kinds(values: dict, names: list[str], files) -> dict[str, str]:
    kinds = {}
    for name in names:
        try:
            kinds[name] = file_kind(files[values[name]])
        except (CheckpointError, OSError, ValueError) as e:
            raise Refused(name, f"{values[name]!r} cannot be read: {e}") from None
    return kinds


def _refuse_clips(names: list[str], files, fixed_type: str | None = None):
    """The validation of a CLIP loader: its type is one sdlite takes, and its files are what that type needs."""
    def refuse(values: dict, lists: Lists) -> None:
        kind_of = fixed_type or values.get("type")
        if kind_of not in TAKEN_TYPES:
            raise Refused("type", f"{kind_of!r}: sdlite takes separate text-encoder files for Z-Image (lumina2), "
                          "FLUX.2 [klein] (flux2), Qwen-Image and Qwen-Image-Edit (qwen_image), SD3 (sd3) and FLUX.1 "
                          "(flux) only; other models load their text encoders from their checkpoint "
                          "(CheckpointLoaderSimple)")
        kinds = _kinds(values, names, files(lists))
        for name, kind in kinds.items():
            if kind in ("VAE", "unknown"):
                raise Refused(name, f"{values[name]!r} holds {'a VAE' if kind == 'VAE' else 'no text encoder'} "
                              "(no T5 'encoder.block...', CLIP 'text_model.embeddings...' nor Qwen "
                              "'layers.0.self_attn...' keys)")
            if kind == "LLM":
                raise Refused(name, f"{values[name]!r} holds an LLM that is no Qwen (its first layer has neither "
                              "Qwen3's q/k norms nor Qwen2's q/k/v biases: Lumina 2's Gemma, a Llama); of LLMs sdlite "
                              "reads Qwen3 (types 'lumina2' for Z-Image, 'flux2' for FLUX.2 [klein]) and "
                              "Qwen2.5-VL-7B (type 'qwen_image')")
            if kind_of == "lumina2" and kind != "Qwen":
                raise Refused(name, f"{values[name]!r} is a {kind}: type 'lumina2' is Z-Image's, whose text encoder "
                              "is the Qwen3-4B LLM (qwen_3_4b.safetensors, or a GGUF of it)")
            if kind_of == "flux2" and kind != "Qwen":
                raise Refused(name, f"{values[name]!r} is a {kind}: type 'flux2' is FLUX.2 [klein]'s, whose text "
                              "encoder is a Qwen3 LLM (qwen_3_4b.safetensors for klein 4B, qwen_3_8b for 9B)")
            if kind_of == "qwen_image" and kind != "Qwen":
                raise Refused(name, f"{values[name]!r} is a {kind}: type 'qwen_image' is Qwen-Image's, whose text "
                              "encoder is the Qwen2.5-VL-7B LLM (qwen_2.5_vl_7b.safetensors, or its fp8 forms)")
            if kind_of not in QWEN_TYPES and kind == "Qwen":
                raise Refused(name, f"{values[name]!r} is a Qwen LLM: load it with type 'lumina2' (Z-Image), "
                              f"'flux2' (FLUX.2 [klein]) or 'qwen_image' (Qwen-Image); type {kind_of!r} takes CLIP "
                              "and T5 files")
            if kind_of == "flux" and kind == "CLIP-G":
                raise Refused(name, f"{values[name]!r} is a CLIP-G (1280 wide): FLUX.1 takes CLIP-L and T5")
        if kind_of == "flux" and len(names) > 1:
            got = sorted("T5" if k == "T5" else "CLIP" for k in kinds.values())
            if got != ["CLIP", "T5"]:
                wrong = names[-1] if got == ["CLIP", "CLIP"] else names[0]
                raise Refused(wrong, f"{values[wrong]!r}: FLUX.1 takes one CLIP-L and one T5; the files are "
                              + ", ".join(f"{name} {kinds[name]}" for name in names))
    return refuse


# --- the nodes ------------------------------------------------------------------------------------------------

def _origin(ctx, class_type: str, values: dict) -> str:
    return f"{class_type} (node {ctx.node_id}) " + ", ".join(f"{k} {v!r}" for k, v in values.items())


def weight_storage(weight_dtype: str) -> str:
    """The engine's weight storage for UNETLoader's ``weight_dtype`` (:data:`WEIGHT_DTYPES`): the ``_fast`` variant
    (fp8 matrix products on GPUs that have them, in ComfyUI) is the same storage here, converted per layer."""
    return weight_dtype.removesuffix("_fast")


def _refuse_dtype(values: dict, lists: Lists) -> None:
    """UNETLoader's fp8 ``weight_dtype``: for a FLUX, SD3, Z-Image or Qwen-Image transformer file, on a server whose
    engines can hold it (not memory mode 0, nor a precision that keeps the weights in int8 / int4)."""
    from ...engine.precision import PrecisionError, check_precision
    from ...weights.flux import is_flux_file
    from ...weights.io import open_checkpoint
    from ...weights.qwenimage import is_qwenimage_file
    from ...weights.sd3 import is_sd3_file
    from ...weights.zimage import is_zimage_file

    value = values.get("weight_dtype", "default")
    if value == "default":
        return
    path = unets(lists)[values["unet_name"]]
    try:
        with open_checkpoint(path) as store:
            keys = list(store.keys())
    except (CheckpointError, OSError, ValueError) as e:
        raise Refused("unet_name", f"{values['unet_name']!r} cannot be read: {e}") from None
    if not (is_flux_file(keys) or is_sd3_file(keys) or is_zimage_file(keys) or is_qwenimage_file(keys)):
        raise Refused("weight_dtype", f"{value!r}: sdlite keeps fp8 weights for FLUX.1, SD3, Z-Image and Qwen-Image "
                      f"transformers; {values['unet_name']!r} is none of them (a UNet's weights stay in the engine's "
                      "precision): use 'default'")
    options = getattr(getattr(lists.server, "engines", None), "load_options", None) or {}
    if options.get("memory_mode", 1) == 0:
        raise Refused("weight_dtype", f"{value!r}: this server runs in memory mode 0, which streams the transformer "
                      "from its file block by block rather than keeping its weights in memory: use 'default'")
    try:
        precision = check_precision(options.get("precision") or "auto")
    except PrecisionError:
        return   # the server's own option, refused when its engines load
    if precision in ("int8", "int4"):
        raise Refused("weight_dtype", f"{value!r}: this server's precision {precision!r} keeps the transformer's "
                      "weights in its own low-bit form: use 'default'")


def _unet_node(name: str, display: str, category: str, files, extra: dict):
    @node(name, display, category, {"unet_name": _names(files), **extra}, ("MODEL",),
          refuse=_refuse_dtype if extra else None)
    def run(ctx, unet_name, weight_dtype="default"):
        path = files(Lists(ctx.server, ctx.dirs))[unet_name]
        checkpoint = Checkpoint(path, f"diffusion_models/{unet_name}")
        shown = {"unet_name": unet_name} | ({"weight_dtype": weight_dtype} if weight_dtype != "default" else {})
        return (ModelRef(checkpoint, origin=_origin(ctx, name, shown), weight_storage=weight_storage(weight_dtype)),)
    return run


_unet_node("UNETLoader", "Load Diffusion Model", "advanced/loaders", unets,
           {"weight_dtype": COMBO(WEIGHT_DTYPES)})
_unet_node("UnetLoaderGGUF", "Unet Loader (GGUF)", "bootleg", gguf_unets, {})


def _clip_node(name: str, display: str, category: str, files, names: list[str], types: tuple | None):
    inputs = {n: _names(files) for n in names}
    if types is not None:
        inputs["type"] = COMBO(types)
    if not name.startswith("Triple") and not name.endswith("GGUF"):
        inputs["device"] = Input("COMBO", {"advanced": True}, choices=("default", "cpu"), required=False)

    @node(name, display, category, inputs, ("CLIP",),
          refuse=_refuse_clips(names, files, None if types is not None else "sd3"))
    def run(ctx, **values):
        found = files(Lists(ctx.server, ctx.dirs))
        paths = tuple(str(found[values[n]]) for n in names)
        return (ClipRef(None, files=paths, origin=_origin(ctx, name, {n: values[n] for n in names})),)
    return run


for _suffix, _category, _files in (("", "advanced/loaders", text_encoders), ("GGUF", "bootleg", gguf_text_encoders)):
    _clip_node(f"CLIPLoader{_suffix}", "Load CLIP" + (" (GGUF)" if _suffix else ""), _category, _files,
               ["clip_name"], CLIP_TYPES)
    _clip_node(f"DualCLIPLoader{_suffix}", "DualCLIPLoader" + (" (GGUF)" if _suffix else ""), _category, _files,
               ["clip_name1", "clip_name2"], DUAL_CLIP_TYPES)
    _clip_node(f"TripleCLIPLoader{_suffix}", "TripleCLIPLoader" + (" (GGUF)" if _suffix else ""), _category,
               _files, ["clip_name1", "clip_name2", "clip_name3"], None)


def _refuse_vae(values: dict, lists: Lists) -> None:
    kind = _kinds(values, ["vae_name"], vaes(lists))["vae_name"]
    if kind != "VAE":
        raise Refused("vae_name", f"{values['vae_name']!r} is not a VAE (no 'decoder.conv_in.weight' key, nor "
                      "Wan 2.1's 'decoder.conv1.weight' of Qwen-Image's VAE)")


@node("VAELoader", "Load VAE", "loaders", {"vae_name": _names(vaes)}, ("VAE",), refuse=_refuse_vae)
def vae_loader(ctx, vae_name):
    path = vaes(Lists(ctx.server, ctx.dirs))[vae_name]
    return (VaeRef(None, file=str(path), origin=_origin(ctx, "VAELoader", {"vae_name": vae_name})),)
