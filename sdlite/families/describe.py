"""How ``sdlite info`` describes a model: its family's name, each network's architecture in a line, its noise
schedule. What differs by family is the family object's answer (:meth:`~sdlite.families.base.Family.info_lines`,
:meth:`~sdlite.families.base.Family.text_encoder_note`)."""
from __future__ import annotations

from ..config import is_bert
from . import family_for

FAMILY_NAMES = {
    "sd1": "Stable Diffusion 1.x",
    "sd2": "Stable Diffusion 2.x",
    "sd1-inpaint": "Stable Diffusion 1.x inpainting",
    "sd2-inpaint": "Stable Diffusion 2.x inpainting",
    "sdxl": "Stable Diffusion XL",
    "sdxl-refiner": "Stable Diffusion XL refiner",
    "sd-x4-upscaler": "Stable Diffusion x4 upscaler",
    "sd3": "Stable Diffusion 3 (Medium)",
    "sd3.5-medium": "Stable Diffusion 3.5 Medium (MMDiT-X)",
    "sd3.5-large": "Stable Diffusion 3.5 Large",
    "flux-dev": "FLUX.1 dev (guidance-distilled)",
    "flux-schnell": "FLUX.1 schnell (timestep-distilled: 1-4 steps)",
    "flux-kontext": "FLUX.1 Kontext dev (instruction editing from a reference image)",
    "z-image-turbo": "Z-Image-Turbo (distilled: 8 steps, no guidance)",
    "qwen-image": "Qwen-Image",
    "qwen-image-edit": "Qwen-Image-Edit (instruction editing from one source image)",
    "qwen-image-edit-plus": "Qwen-Image-Edit-2509 / 2511 (instruction editing from up to 3 source images)",
}


def family_name(spec) -> str:
    """How ``sdlite info`` names a model's family: "Stable Diffusion 1.x", or for Taiyi "Taiyi, Chinese BERT text
    encoder" (SD 1.x's UNet and VAE with a BERT text tower)."""
    if is_bert(spec.text):
        return "Taiyi, Chinese BERT text encoder"
    name = FAMILY_NAMES.get(spec.family, spec.family)
    if spec.turbo:
        return f"{name}, Turbo (distilled: 1-4 steps, no guidance)"
    return name


def describe_component(name: str, spec) -> str:
    if name == "text_encoder" and is_bert(spec.text):
        t = spec.text
        return (f"BERT text encoder: {t.layers} layers, width {t.width}, {t.heads} heads, gelu, vocabulary "
                f"{t.vocab_size}, {t.max_positions} positions (the UNet reads all {t.max_positions}, padding "
                "included)")
    if name == "text_encoder" and getattr(spec.text, "architecture", None) == "qwen":
        t = spec.text
        return (f"Qwen{'3' if t.qk_norm else '2.5'} decoder: {t.num_hidden_layers} layers, width {t.hidden_size}, "
                f"{t.num_attention_heads} query heads / {t.num_key_value_heads} key-value heads of {t.head_dim}, "
                f"feed-forward {t.intermediate_size} SwiGLU, vocabulary {t.vocab_size}"
                f"{family_for(spec).text_encoder_note(name)}")
    if name in ("text_encoder", "text_encoder_2"):
        t = spec.text if name == "text_encoder" else spec.text2
        kind = {768: "CLIP ViT-L/14 text tower", 1024: "OpenCLIP ViT-H text tower",
                1280: "OpenCLIP ViT-bigG text tower"}.get(t.width, "CLIP text tower")
        extra = family_for(spec).text_encoder_note(name)
        return f"{kind}: {t.layers} layers, width {t.width}, {t.heads} heads, {t.activation}{extra}"
    if name == "text_encoder_3":
        t = spec.text3
        return (f"T5 encoder (v1.1): {t.num_layers} layers, width {t.d_model}, {t.num_heads} heads, feed-forward "
                f"{t.d_ff} {t.feed_forward_proj}{family_for(spec).text_encoder_note(name)}")
    if name == "transformer" and type(t := spec.transformer).__name__ == "Flux2Config":
        return (f"FLUX.2 transformer: {t.num_layers} double and {t.num_single_layers} single blocks, width {t.hidden} "
                f"({t.num_attention_heads} heads of {t.attention_head_dim}, rotary axes "
                f"{'/'.join(map(str, t.axes_dims_rope))}), {t.in_channels} values a token (2x2 patches of "
                f"{t.latent_channels} latent channels), text context {t.joint_attention_dim}, shared modulations"
                + (", guidance embedding" if t.guidance_embeds else ""))
    if name == "transformer" and type(t := spec.transformer).__name__ == "QwenImageConfig":
        return (f"Qwen-Image MMDiT: {t.num_layers} double-stream blocks, width {t.hidden} ({t.num_attention_heads} "
                f"heads of {t.attention_head_dim}, rotary axes {'/'.join(map(str, t.axes_dims_rope))}), "
                f"{t.latent_channels} latent channels in 2x2 patches, text context {t.joint_attention_dim}"
                + (", source images modulated at timestep 0" if t.zero_cond_t else ""))
    if name == "transformer" and hasattr(t := spec.transformer, "num_single_layers"):
        return (f"FLUX transformer: {t.num_layers} double and {t.num_single_layers} single blocks, width {t.hidden} "
                f"({t.num_attention_heads} heads of {t.attention_head_dim}, rotary axes "
                f"{'/'.join(map(str, t.axes_dims_rope))}), {t.latent_channels} latent channels in 2x2 patches, text "
                f"context {t.joint_attention_dim}, pooled {t.pooled_projection_dim}"
                + (", guidance embedding" if t.guidance_embeds else ""))
    if name == "transformer" and hasattr(t := spec.transformer, "n_refiner_layers"):
        return (f"Z-Image S3-DiT: {t.n_layers} joint blocks after {t.n_refiner_layers} noise and "
                f"{t.n_refiner_layers} context refiner blocks, width {t.dim} ({t.n_heads} heads of {t.head_dim}, "
                f"rotary axes {'/'.join(map(str, t.axes_dims))}), {t.in_channels} latent channels in 2x2 patches, "
                f"caption width {t.cap_feat_dim}")
    if name == "transformer":
        t = spec.transformer
        return (f"MMDiT: {t.num_layers} joint blocks, width {t.hidden} ({t.num_attention_heads} heads of "
                f"{t.attention_head_dim}), patch {t.patch_size}, {t.in_channels} latent channels, text context "
                f"{t.joint_attention_dim}, pooled {t.pooled_projection_dim}, positions up to "
                f"{t.pos_embed_max_size * t.patch_size} latent pixels a side"
                + (", qk RMS norm" if t.qk_norm else "")
                + (f", dual attention in {len(t.dual_attention_layers)} blocks" if t.dual_attention_layers else ""))
    if name == "unet":
        u = spec.unet
        depth = u.transformer_depth
        return (f"UNet: {u.in_channels} in-channels, widths {list(u.block_channels)}, {u.layers_per_block} "
                f"res blocks/level, heads {list(u.heads)}, context {u.context_dim}, "
                f"{'linear' if u.linear_projection else 'conv'} projections"
                + (f", transformer depth {_listed(depth)}" if depth != 1 else "")
                + (f" (up {_listed(u.up_transformer_depth)})" if u.up_transformer_depth else "")
                + {"cross_attn": "", "resnet": ", one-resnet middle block", None: ", no middle block"}[u.mid_block]
                + (f", added conditioning: pooled text + {(u.add_embed_in - spec.text2.projection_dim) // u.addition_time_embed_dim}"
                   f" {'size/crop/aesthetic' if spec.requires_aesthetics_score else 'size/crop'} ids"
                   if u.addition_embed == "text_time" and spec.text2 is not None else ""))
    v = spec.vae
    if hasattr(v, "latents_std"):   # Qwen-Image's
        return (f"AutoencoderKLQwenImage (one frame): widths {list(v.block_channels)}, {v.latent_channels} latent "
                f"channels, {v.downscale}x downsampling, normalised by its per-channel latents_mean / latents_std")
    if hasattr(v, "patched_channels"):   # FLUX.2's
        return (f"AutoencoderKLFlux2: widths {list(v.block_channels)}"
                + (f" (decoder {list(v.decoder_widths)})" if v.decoder_widths != v.block_channels else "")
                + f", {v.latent_channels} latent channels, {v.downscale}x downsampling, patchified 2x2 to "
                f"{v.patched_channels} channels and normalised by its batch-norm statistics")
    return f"AutoencoderKL: widths {list(v.block_channels)}, {v.latent_channels} latent channels, " \
           f"{v.downscale}x downsampling, scaling factor {v.scaling_factor}" + \
           (f", shift {v.shift_factor}" if v.shift_factor else "")


def describe_schedule(cfg: dict) -> str:
    if cfg.get("_class_name", "").startswith("FlowMatch") or "shift" in cfg:
        dynamic = cfg.get("use_dynamic_shifting")
        return (f"flow matching over {cfg.get('num_train_timesteps', 1000)} steps, "
                + ("shift from the image size (mu)" if dynamic else f"shift {cfg.get('shift', 1.0)}")
                + (f" ({cfg['_class_name']})" if cfg.get("_class_name") else ""))
    spacing = cfg.get("timestep_spacing") or "each sampler's default"
    betas = cfg.get("beta_schedule", "linear") if cfg.get("trained_betas") is None else "trained"
    return (f"{betas} betas {cfg.get('beta_start', 0.0001)}..{cfg.get('beta_end', 0.02)} over "
            f"{cfg.get('num_train_timesteps', 1000)} steps, timestep spacing {spacing}, steps offset "
            f"{cfg.get('steps_offset', 0)}" + (f" ({cfg['_class_name']})" if cfg.get("_class_name") else ""))


def _listed(depth) -> list | int:
    """A transformer depth as a list (per level; a level's per-layer depths as a list in it), or one number."""
    return [list(d) if isinstance(d, tuple) else d for d in depth] if isinstance(depth, tuple) else depth
