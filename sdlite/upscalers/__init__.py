"""Image upscalers: ESRGAN-family super-resolution nets (RRDBNet: ESRGAN, Real-ESRGAN x4plus/x2plus and the
community models of that architecture; SRVGGNetCompact: realesr-general-x4v3, realesr-animevideov3), read from
the files people have, and run over images of any size in overlapping tiles.

    from sdlite.upscalers import load_upscaler, upscale
    up = load_upscaler("RealESRGAN_x4plus.pth")       # up.arch == "RRDBNet", up.scale == 4
    big = upscale(up, image)                           # a PIL image 4x as wide and high

:data:`DEMO_UPSCALER` is the small 4x upscaler shipped for the demo model's 64x64 pictures (trained by
``tools/train_demo_upscaler.py``).
"""
from pathlib import Path

from .files import ARCHS, Upscaler, UpscalerError, load_upscaler
from .nets import RRDBConfig, RRDBNet, SRVGGConfig, SRVGGNetCompact
from .tiling import DEFAULT_TILE, default_overlap, upscale, upscale_tensor

DEMO_UPSCALER = Path(__file__).resolve().parent.parent / "data" / "upscalers" / "demo-4x.safetensors"

__all__ = ["DEMO_UPSCALER", "ARCHS", "Upscaler", "UpscalerError", "load_upscaler", "RRDBConfig", "RRDBNet",
           "SRVGGConfig", "SRVGGNetCompact", "DEFAULT_TILE", "default_overlap", "upscale", "upscale_tensor"]
