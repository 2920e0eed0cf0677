"""How much memory a generation needs, how a large batch is cut into pieces, and how much memory there is.

A generation runs in phases one after another -- text encoding, the sampling loop (the UNet), the VAE decode (and,
for image to image, an encode first) -- and frees each phase's temporaries before the next, so its peak above what
is already resident is the largest phase's: the weights that phase must load (memory modes 0 and 2, or a network
not built yet) plus its activations. :func:`estimate` computes that from the model's shapes, the size, the batch,
the memory mode and the tiling, with coefficients fitted to measurements (``bench/admission.py`` measures the peak
RSS of each phase in a fresh process and prints it beside the estimate):

* UNet call: ``UNET_FIXED + 0.05 x UNet weights + rows x latent pixels x 47 x C0 x 4 bytes`` (C0: the first level's
  width; rows: 2 an image with classifier-free guidance). SD 1.5, 512x512, batch 1 (2 rows): 718 MB measured,
  800 MB estimated.
* VAE decode of n images: ``VAE_FIXED + 0.2 x VAE weights + n x pixels x 9 x C0 x 4 bytes`` untiled (SD 1.5,
  512x512: 933 MB measured, 1220 MB estimated); tiled, one tile's worth of that plus the full-resolution layers
  kept whole, ``2 x C1 x pixels x 4 bytes`` (SD 1.5, 1024x1024: 2415 MB measured, 2950 MB estimated).

**Pieces.** A batch whose UNet activations would exceed :data:`UNET_PIECE_BYTES`, or whose decode would exceed
:data:`DECODE_PIECE_BYTES`, runs in pieces of as many images as fit (at least one): the UNet over each piece in
turn at every step, the decoder piece by piece. The rule depends only on the model, the request and the device,
never on the memory free at the time, so a request gives the same images bit for bit on a busy server and an idle
one; and each piece is computed exactly as a batch of that many images would be (same shapes, same inputs), so
image ``i`` of a pieced batch equals image ``i`` of the piece-sized batch that starts at its seed.

**Memory there is.** :func:`memory_now` reads the kernel's MemAvailable and MemTotal, and a cgroup's limit and
usage where the process runs under one (containers), whichever is tighter.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

MB = 1 << 20
UNET_FIXED = 80 * MB          # workspaces (Winograd's, oneDNN's) and the small tensors of one UNet call
VAE_FIXED = 128 * MB
TEXT_ACTIVATIONS = 64 * MB    # one text-encoder pass over a few 77-token chunks
UNET_ROW_PIXEL_FLOATS = 47    # x C0: live floats a latent pixel of one UNet row needs at the call's peak
DECODE_PIXEL_FLOATS = 9       # x the decoder's last width: live floats an image pixel needs in an untiled decode
TILED_FULL_RES_FLOATS = 2.0   # x the decoder's second width: the full-resolution layers a tiled decode keeps whole
# a transformer's live floats per token at a call's peak, x its width (the joint attention's q, k, v and output
# and a 4x MLP's hidden layer beside the residual stream: an estimate from the network's shapes, not yet fitted to
# measurements as the UNet's is), and the text tokens it attends with (SD3: 77 CLIP + 256 T5)
TRANSFORMER_TOKEN_FLOATS = 10
TRANSFORMER_TEXT_TOKENS = 333
STREAM_SHARE = 0.15           # memory mode 0: the largest streamed block, as a share of the UNet's weights
# a batch runs in pieces above these (estimated activations of one call): the same on every machine of a device kind
UNET_PIECE_BYTES = {"cpu": 1536 * MB, "mps": 1536 * MB, "cuda": 4096 * MB}
DECODE_PIECE_BYTES = {"cpu": 1024 * MB, "mps": 1024 * MB, "cuda": 2048 * MB}


@dataclass
class Estimate:
    """The peak memory above what is resident now, by phase (bytes), and the pieces the batch runs in."""

    phases: dict = field(default_factory=dict)      # phase -> bytes
    unet_piece: int = 1                             # images per UNet call
    decode_piece: int = 1                           # images per decoder call

    @property
    def peak(self) -> int:
        return max(self.phases.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get) if self.phases else ""

    def describe(self) -> str:
        parts = ", ".join(f"{name} {value / MB:.0f} MB" for name, value in self.phases.items())
        return f"{self.peak / MB:.0f} MB at its peak ({parts})"


def _weights_bytes(engine, name: str) -> int:
    """Bytes network ``name`` takes once built in its compute dtype (0 when the engine has no file to read)."""
    models = engine.models
    ckpt = getattr(models, "ckpt", None)
    if ckpt is None or name not in getattr(ckpt, "sources", {}):
        return 0
    itemsize = models.dtype_of(name).itemsize
    return sum(math.prod(shape) for shape in ckpt.sources[name].shapes.values()) * itemsize


def _to_load(engine, name: str) -> int:
    """Bytes network ``name`` adds when the engine uses it: nothing when resident, the largest streamed block when
    memory mode 0 streams it from the file, else the whole network."""
    models = engine.models
    if name in models.resident():
        return 0
    size = _weights_bytes(engine, name)
    if name == engine.spec.denoiser and models.mode == 0:
        return int(size * STREAM_SHARE)
    return size


def _unet_rows_bytes(engine, rows: int, latent_pixels: int) -> int:
    """The activations of ``rows`` UNet rows over ``latent_pixels`` latent pixels (what grows with the batch); for a
    transformer (SD3), its image tokens (a patch of 2x2 latent pixels each) and text tokens at its width."""
    spec = engine.spec
    if spec.unet is None:
        t = spec.transformer
        tokens = latent_pixels // (t.patch_size ** 2) + TRANSFORMER_TEXT_TOKENS
        width = t.dim if hasattr(t, "dim") else t.num_attention_heads * t.attention_head_dim   # Z-Image: dim
        return rows * tokens * TRANSFORMER_TOKEN_FLOATS * width * 4
    return rows * latent_pixels * UNET_ROW_PIXEL_FLOATS * spec.unet.block_channels[0] * 4


def unet_call_bytes(engine, rows: int, latent_pixels: int) -> int:
    """The activations of one denoiser call (the UNet's, or a transformer's)."""
    weights = _weights_bytes(engine, engine.spec.denoiser)
    return UNET_FIXED + int(0.05 * weights) + _unet_rows_bytes(engine, rows, latent_pixels)


def _vae_image_bytes(engine, height: int, width: int, tile: int) -> int:
    """The activations one image of ``height`` x ``width`` pixels adds to a decode (or encode) tiled in tiles of
    ``tile`` latent pixels (0: untiled)."""
    vae = engine.spec.vae
    channels = vae.block_channels
    scale = vae.downscale
    if not tile or (height <= tile * scale and width <= tile * scale):
        return height * width * DECODE_PIXEL_FLOATS * channels[0] * 4
    one_tile = min(height, tile * scale) * min(width, tile * scale) * DECODE_PIXEL_FLOATS * channels[0] * 4
    full = TILED_FULL_RES_FLOATS * channels[min(1, len(channels) - 1)] * height * width * 4
    return int(one_tile + full)


def vae_call_bytes(engine, images: int, height: int, width: int, tile: int) -> int:
    """A decode (or encode) of ``images`` images of ``height`` x ``width`` pixels, tiled in tiles of ``tile`` latent
    pixels (0: untiled)."""
    fixed = VAE_FIXED + int(0.2 * _weights_bytes(engine, "vae"))
    return fixed + images * _vae_image_bytes(engine, height, width, tile)


def pieces(engine, height: int, width: int, batch_size: int, cfg: bool = True) -> tuple[int, int]:
    """(images per UNet call, images per decoder call) for a batch of ``batch_size`` images of ``height`` x ``width``
    pixels; ``cfg``: each image is two rows of the UNet's batch (classifier-free guidance)."""
    device = getattr(engine, "device", None)
    kind = getattr(device, "type", "cpu")
    unet_cap = getattr(engine, "unet_piece_bytes", None) or UNET_PIECE_BYTES.get(kind, UNET_PIECE_BYTES["cpu"])
    decode_cap = getattr(engine, "decode_piece_bytes", None) or DECODE_PIECE_BYTES.get(kind, DECODE_PIECE_BYTES["cpu"])
    scale = engine.spec.vae.downscale
    latent_pixels = (height // scale) * (width // scale)
    per_image = _unet_rows_bytes(engine, 2 if cfg else 1, latent_pixels)
    unet_piece = max(1, min(batch_size, unet_cap // max(per_image, 1)))
    tile = engine.decode_tile(height // scale, width // scale)
    one = _vae_image_bytes(engine, height, width, tile)
    decode_piece = max(1, min(batch_size, decode_cap // max(one, 1)))
    return int(unet_piece), int(decode_piece)


def estimate(engine, height: int, width: int, batch_size: int, cfg: bool = True, *, encode: bool = False,
             refiner: bool = False) -> Estimate:
    """The peak memory a generation needs above what ``engine`` holds now: ``batch_size`` images of ``height`` x
    ``width`` pixels, ``cfg`` as :func:`pieces` takes it; ``encode``: an init image is encoded first (image to image,
    inpainting); ``refiner``: the engine's refiner takes the latents over."""
    unet_piece, decode_piece = pieces(engine, height, width, batch_size, cfg)
    scale = engine.spec.vae.downscale
    latent_pixels = (height // scale) * (width // scale)
    rows = (2 if cfg else 1) * unet_piece
    phases = {}
    text = sum(_to_load(engine, name) for name in engine.spec.text_encoders)
    phases["text"] = text + TEXT_ACTIVATIONS
    tile = engine.decode_tile(height // scale, width // scale)
    vae_load = _to_load(engine, "vae")
    if encode:
        phases["encode"] = vae_load + vae_call_bytes(engine, 1, height, width, 0)
    phases["sampling"] = _to_load(engine, engine.spec.denoiser) + unet_call_bytes(engine, rows, latent_pixels)
    # the decode's output (B, 3, H, W) in fp32 and the images, beside the decoder's temporaries
    images = batch_size * height * width * (3 * 4 + 3)
    phases["decode"] = vae_load + vae_call_bytes(engine, decode_piece, height, width, tile) + images
    other = getattr(engine, "refiner", None)
    if refiner and other is not None and other is not engine:
        phases["refiner"] = _to_load(other, other.spec.denoiser) + unet_call_bytes(other, rows, latent_pixels)
    return Estimate(phases, unet_piece, decode_piece)


# --- the memory there is ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Memory:
    available: int        # bytes that can be allocated now without swapping or the OOM killer
    total: int            # bytes this process could ever have (the machine's, or its cgroup's limit)


def _meminfo() -> dict:
    values = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                values[key] = int(parts[0]) * 1024
    except OSError:
        pass
    return values


def _cgroup() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's cgroup (v2, or v1's memory controller); None where there is no limit."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":   # v2
            base = Path("/sys/fs/cgroup") / path.lstrip("/")
            limit_file, usage_file = base / "memory.max", base / "memory.current"
        elif "memory" in controllers.split(","):
            base = Path("/sys/fs/cgroup/memory") / path.lstrip("/")
            limit_file, usage_file = base / "memory.limit_in_bytes", base / "memory.usage_in_bytes"
        else:
            continue
        try:
            limit_text = limit_file.read_text().strip()
            usage = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        if limit_text == "max" or not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None, usage
        return int(limit_text), usage
    return None, None


def memory_now() -> Memory | None:
    """What the machine (or this process's cgroup) has now; None where it cannot be read (then nothing is refused
    for memory)."""
    info = _meminfo()
    if "MemAvailable" in info and "MemTotal" in info:
        available, total = info["MemAvailable"], info["MemTotal"]
    else:
        try:
            import psutil

            vm = psutil.virtual_memory()
            available, total = vm.available, vm.total
        except ImportError:
            return None
    limit, usage = _cgroup()
    if limit is not None:
        total = min(total, limit)
        if usage is not None:
            available = min(available, max(limit - usage, 0))
    return Memory(available, total)


def process_rss() -> int:
    """This process's resident memory, bytes."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except ImportError:
            return 0
