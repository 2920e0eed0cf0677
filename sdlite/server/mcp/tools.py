"""MCP's tools over the server: ``generate``, ``img2img``, ``inpaint``, ``edit_image`` (FLUX.2 [klein]'s instruction
editing), ``upscale``, ``list_models``, ``list_samplers``.

Each tool checks its arguments (an error names the argument), turns them into an AUTOMATIC1111 request and from it a
:class:`~.a1111.Plan` (:func:`~.a1111.build_plan`: the server's limits, names and checks), and hands the plan to the
server (:meth:`~.backend.ServerBase.generate`): the same queue, admission and Ray scale-out as ``/sdapi/v1``. The
images come back as MCP image content (PNG, base64, each with its ``parameters`` chunk), each followed by a text
block with its seed and A1111 infotext; ``structuredContent`` holds the same as JSON. A job's sampler steps are sent
as MCP progress notifications when the client gave a progress token (in-process servers; a Ray cluster's replicas do
not report steps). The upscale is the server's (:meth:`~.backend.ServerBase.upscale`): A1111's extras, outside the
queue, one upscale at a time with theirs.

Images in are base64 (raw or a ``data:`` URI). Only where the tools serve this machine's user alone (``sdlite mcp``
on stdio) may a call name a file to read instead (``image_path``, ``mask_path``); over HTTP those arguments are not
offered, so that no client can make the server read its files.

The transports (stdio, streamable HTTP under ``/mcp``) are :mod:`.server`'s.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
from pathlib import Path
from typing import Any, Literal

from fastapi import HTTPException
from mcp import types
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.concurrency import run_in_threadpool

from ...config import MAX_BATCH, MAX_STEPS
from ...errors import SDLiteError
from ..a1111 import api as a1111
from ..backend import ServerBase
from ..jobs import Unavailable

log = logging.getLogger("sdlite.server")

DEFAULT_STEPS, DEFAULT_CFG, DEFAULT_SAMPLER = 20, 7.0, "DPM++ 2M"   # A1111's web UI defaults (the API's: 50 steps)
# a call's defaults as A1111's fields, where the model's family has no settings of its own (FLUX.1, SD3, Z-Image have)
DEFAULTS = {"steps": DEFAULT_STEPS, "cfg_scale": DEFAULT_CFG, "sampler_name": DEFAULT_SAMPLER}


# --- the arguments ------------------------------------------------------------------------------------------------

class _Arguments(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())


class _Sampling(_Arguments):
    prompt: str = Field(description="What to draw. A1111 prompt syntax: (word:1.2) weights, [from:to:when], "
                                    "<lora:NAME:WEIGHT> for the server's LoRAs (list_models)")
    negative_prompt: str = Field("", description="What not to draw")
    steps: int = Field(DEFAULT_STEPS, ge=1, le=MAX_STEPS, description="Sampler steps (left out: the model's own "
                                                                      "where it has them: FLUX.1, SD3, Z-Image)")
    cfg_scale: float = Field(DEFAULT_CFG, ge=0, le=100, description="Classifier-free guidance scale (1: no "
                                                                      "negative pass; left out: the model's own "
                                                                      "where it has one)")
    sampler: str = Field(DEFAULT_SAMPLER, description="An A1111 sampler name (list_samplers), optionally with a "
                                                      "scheduler after it ('DPM++ 2M Karras'), or sdlite's name "
                                                      "(left out: the model's own where it has one)")
    scheduler: str | None = Field(None, description="An A1111 scheduler (list_samplers); default: the sampler's own")
    seed: int = Field(-1, ge=-1, description="Seed of the first image (the next ones count up); -1: random")
    batch_size: int = Field(1, ge=1, le=MAX_BATCH, description="Images to generate")
    model: str | None = Field(None, description="A checkpoint of list_models (its name or title), for this call "
                                                "only; default: the server's current model")


class GenerateArguments(_Sampling):
    width: int | None = Field(None, ge=8, le=8192, description="Multiple of 8; default: the model's native size")
    height: int | None = Field(None, ge=8, le=8192, description="Multiple of 8; default: the model's native size")


class _Source(_Arguments):
    image: str | None = Field(None, description="The source image, base64 (PNG, JPEG, WebP; a data: URI too)")
    image_path: str | None = Field(None, description="Instead of image: a file on this machine to read")


class Img2ImgArguments(_Sampling, _Source):
    denoising_strength: float = Field(0.75, ge=0, le=1, description="How much of the source is redrawn (0: none, "
                                                                    "1: all)")
    width: int | None = Field(None, ge=8, le=8192, description="Multiple of 8; default: the source's width")
    height: int | None = Field(None, ge=8, le=8192, description="Multiple of 8; default: the source's height")


INPAINT_FILLS = {"fill": 0, "original": 1, "latent noise": 2, "latent nothing": 3}   # A1111's inpainting_fill


class InpaintArguments(Img2ImgArguments):
    mask: str | None = Field(None, description="The mask, base64: white is redrawn, black kept (same size as the "
                                               "image)")
    mask_path: str | None = Field(None, description="Instead of mask: a file on this machine to read")
    mask_blur: int = Field(4, ge=0, le=64, description="Pixels of blur at the mask's edge")
    inpainting_fill: Literal["fill", "original", "latent noise", "latent nothing"] = Field(
        "original", description="What the masked area starts from")
    inpaint_area: Literal["whole", "masked"] = Field(
        "whole", description="whole: the whole picture at its size; masked: the masked area alone, at full size")
    invert_mask: bool = Field(False, description="Redraw the black area instead")


class UpscaleArguments(_Source):
    upscaler: str = Field(description="An upscaler of list_models: a network of the server's upscaler folder, or a "
                                      "built-in (Lanczos, Nearest)")
    scale: float = Field(2.0, gt=0, le=8, description="Size factor")


class EditImageArguments(_Source):
    instruction: str = Field(description="What to change, in words ('make the sky a sunset', 'put the cat from the "
                                         "second image on the sofa'): the prompt")
    reference_images: list[str] = Field([], description="More reference images after image, base64, in order (the "
                                                        "prompt may name them: 'the second image')")
    reference_image_paths: list[str] = Field([], description="Instead of reference_images: files on this machine")
    width: int | None = Field(None, ge=16, le=8192, description="Multiple of 16; default: the image's width")
    height: int | None = Field(None, ge=16, le=8192, description="Multiple of 16; default: the image's height")
    steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Sampler steps (left out: the model's own)")
    seed: int = Field(-1, ge=-1, description="Seed; -1: random")
    model: str | None = Field(None, description="A checkpoint of list_models that edits from reference images "
                                                "(FLUX.2 [klein]), for this call only; default: the current model")


class _NoArguments(_Arguments):
    pass


TOOLS: dict[str, tuple[type[_Arguments], str, str]] = {
    "generate": (GenerateArguments, "Generate images", "Text to image: generate images from a prompt with Stable "
                 "Diffusion. Returns PNG images and, for each, its seed and parameters (A1111 infotext)."),
    "img2img": (Img2ImgArguments, "Redraw an image", "Image to image: redraw a source image after a prompt. "
                "Returns PNG images and their parameters."),
    "inpaint": (InpaintArguments, "Inpaint an image", "Redraw the masked part of an image after a prompt, keeping "
                "the rest. Returns PNG images and their parameters."),
    "upscale": (UpscaleArguments, "Upscale an image", "Enlarge an image with an upscaler network or a built-in "
                "resampler (A1111's extras). Returns the PNG."),
    "edit_image": (EditImageArguments, "Edit an image by instruction", "Instruction editing with a model that edits "
                   "from reference images (FLUX.2 [klein]): the image, and any more reference images, are what the "
                   "model sees beside the instruction; the output is drawn from noise at the image's size. Returns "
                   "PNG images and their parameters. Other models refuse it (use img2img or inpaint)."),
    "list_models": (_NoArguments, "List models", "The checkpoints the server can generate with (the current one "
                    "marked), its upscalers and its LoRAs."),
    "list_samplers": (_NoArguments, "List samplers", "The sampler and scheduler names the generating tools take."),
}
_LOCAL_FILES = ("image_path", "mask_path", "reference_image_paths")


def _schema(model: type[_Arguments], local_files: bool) -> dict:
    schema = model.model_json_schema()
    schema.pop("title", None)
    if not local_files:
        for name in _LOCAL_FILES:
            schema.get("properties", {}).pop(name, None)
    return schema


class ToolError(Exception):
    """A call refused or failed: its message goes back as the tool's error result."""


def _argument_errors(e: ValidationError) -> str:
    """Each bad argument named, with what was wrong."""
    parts = []
    for error in e.errors():
        name = ".".join(str(part) for part in error["loc"]) or "arguments"
        if error["type"] == "missing":
            parts.append(f"{name}: required")
        elif error["type"] == "extra_forbidden":
            parts.append(f"{name}: not an argument of this tool")
        else:
            value = repr(error.get("input"))
            value = value if len(value) <= 60 else value[:57] + "..."
            parts.append(f"{name}={value}: {error['msg']}")
    return "invalid arguments: " + "; ".join(parts)


# --- running a call -----------------------------------------------------------------------------------------------

class McpCall:
    """What :meth:`ServerBase.generate` polls in place of an HTTP request. An MCP call ends by cancellation (the
    client's ``notifications/cancelled``, or its session closing), which reaches the awaiting job as
    CancelledError (the job is dropped, or interrupted), so it never reports a disconnect itself."""

    async def is_disconnected(self) -> bool:
        return False


class StepProgress:
    """Carries a job's sampler steps from the queue's worker thread to the MCP client as progress notifications
    (the SDK sends none when the call carried no progress token). Only the newest step is sent when several
    arrive at once; the last one is sent before the call answers."""

    def __init__(self, session):
        self._session = session
        self._loop = asyncio.get_running_loop()
        self._latest: tuple[float, float, str] | None = None
        self._ready = asyncio.Event()
        self._done = False
        self._sent = -1.0

    def __call__(self, iteration: int, iterations: int, step: int, steps: int) -> None:   # the worker thread
        value = (iteration * steps + step, iterations * steps,
                 f"image {iteration + 1} of {iterations}, step {step} of {steps}")
        try:
            self._loop.call_soon_threadsafe(self._post, value)
        except RuntimeError:   # the loop is closed: nobody waits for this job any more
            pass

    def _post(self, value) -> None:
        self._latest = value
        self._ready.set()

    async def _forward(self) -> None:
        while True:
            await self._ready.wait()
            self._ready.clear()
            if self._latest is not None and self._latest[0] > self._sent:
                done, total, message = self._latest
                self._sent = done
                try:
                    await self._session.report_progress(done, total, message)
                except Exception as e:  # noqa: BLE001 - the client is gone; the job's answer tells the rest
                    log.debug("MCP progress not sent: %s", e)
                    return
            if self._done:
                return

    async def run(self, awaitable):
        """``awaitable``'s result, with the steps forwarded meanwhile."""
        forwarder = asyncio.ensure_future(self._forward())
        try:
            result = await awaitable
        except BaseException:
            forwarder.cancel()
            raise
        self._done = True
        self._ready.set()
        await forwarder
        return result


class Tools:
    """The tools over ``server`` (any :class:`~.backend.ServerBase`). ``local_files``: calls may name files on this
    machine (``sdlite mcp`` on stdio only)."""

    def __init__(self, server: ServerBase, local_files: bool = False):
        self.server, self.local_files = server, local_files

    def describe(self) -> list[types.Tool]:
        return [types.Tool(name=name, title=title, description=description,
                           input_schema=_schema(model, self.local_files),
                           annotations=types.ToolAnnotations(read_only_hint=True, open_world_hint=False))
                for name, (model, title, description) in TOOLS.items()]

    async def call(self, name: str, arguments: dict[str, Any], session) -> types.CallToolResult:
        """Run tool ``name``; a bad argument or a refused or failed job is an error result saying why.
        ``session``: the MCP session the progress notifications go to."""
        model = TOOLS[name][0]
        try:
            try:
                args = model.model_validate(arguments)
            except ValidationError as e:
                raise ToolError(_argument_errors(e)) from None
            if name in ("generate", "img2img", "inpaint", "edit_image"):
                return await self._generate(name, args, session)
            if name == "upscale":
                return await self._upscale(args)
            return await self._list(name)
        except ToolError as e:
            message = str(e)
        except HTTPException as e:   # the checks the A1111 routes share: a model or an image not found
            message = str(e.detail)
        except Unavailable as e:
            message = f"{e} (retry in about {e.retry_after} s)"
        except SDLiteError as e:   # a bad value, a limit, an image too large, a model that cannot be loaded
            message = str(e)
        except MemoryError:
            message = "the job ran out of memory; retry with a smaller size or batch"
        except Exception as e:  # noqa: BLE001 - answered as the tool's error; the log has the traceback
            log.exception("MCP tool %s failed", name)
            message = f"internal error ({type(e).__name__}: {e}); the server log has the details"
        return types.CallToolResult(content=[types.TextContent(text=f"{name}: {message}")], is_error=True)

    # --- the tools ----------------------------------------------------------------------------------------------

    def _image(self, data: str | None, path: str | None, name: str) -> str:
        """The image argument ``name`` (or ``name``_path) as base64."""
        if data is not None and path is not None:
            raise ToolError(f"give {name} or {name}_path, not both")
        if path is not None:
            if not self.local_files:
                raise ToolError(f"{name}_path: this server reads no files for its clients; send {name} as base64")
            file = Path(path).expanduser()
            if not file.is_file():
                raise ToolError(f"{name}_path {path!r}: no such file")
            if file.stat().st_size > self.server.max_body_bytes:
                raise ToolError(f"{name}_path {path!r}: {file.stat().st_size} bytes, more than the cap of "
                                f"{self.server.max_body_bytes}")
            return base64.b64encode(file.read_bytes()).decode("ascii")
        if data is None:
            raise ToolError(f"{name}: required (base64){f', or {name}_path' if self.local_files else ''}")
        return data

    def _fields(self, tool: str, args) -> dict:
        """The A1111 request's fields of a generating tool's arguments: steps, cfg_scale and sampler only where the
        call gives them (left out, they are the model's own where its family has settings of its own, else
        :data:`DEFAULTS`)."""
        given = args.model_fields_set
        fields = dict(prompt=args.prompt, negative_prompt=args.negative_prompt,
                      steps=args.steps if "steps" in given else None,
                      cfg_scale=args.cfg_scale if "cfg_scale" in given else None,
                      sampler_name=args.sampler if "sampler" in given else None, scheduler=args.scheduler,
                      seed=args.seed, batch_size=args.batch_size, width=args.width, height=args.height)
        if args.model is not None:
            fields["override_settings"] = {"sd_model_checkpoint": args.model}
        if tool != "generate":
            fields.update(init_images=[self._image(args.image, args.image_path, "image")],
                          denoising_strength=args.denoising_strength)
        if tool == "inpaint":
            fields.update(mask=self._image(args.mask, args.mask_path, "mask"), mask_blur=args.mask_blur,
                          inpainting_fill=INPAINT_FILLS[args.inpainting_fill],
                          inpaint_full_res=args.inpaint_area == "masked", inpainting_mask_invert=int(args.invert_mask))
        return fields

    def _edit_fields(self, args: EditImageArguments) -> dict:
        """The A1111 img2img fields of an ``edit_image`` call: every image an init image, which the plan makes the
        reference images (:func:`~.a1111.references.with_references`, "required": other models refuse)."""
        if args.reference_images and args.reference_image_paths:
            raise ToolError("give reference_images or reference_image_paths, not both")
        images = [self._image(args.image, args.image_path, "image")]
        images += [self._image(data, None, f"reference_images[{i}]") for i, data in enumerate(args.reference_images)]
        images += [self._image(None, path, f"reference_images[{i}]")
                   for i, path in enumerate(args.reference_image_paths)]
        fields = dict(prompt=args.instruction, steps=args.steps, seed=args.seed, width=args.width,
                      height=args.height, init_images=images, denoising_strength=1.0)
        if args.model is not None:
            fields["override_settings"] = {"sd_model_checkpoint": args.model}
        return fields

    async def _generate(self, tool: str, args, session) -> types.CallToolResult:
        server = self.server
        fields = await run_in_threadpool(self._edit_fields if tool == "edit_image" else self._fields,
                                         *(() if tool == "edit_image" else (tool,)), args)
        request = (a1111.Txt2ImgRequest if tool == "generate" else a1111.Img2ImgRequest)(**fields)
        plan = await run_in_threadpool(server.build_plan, request, None, DEFAULTS)
        if tool == "edit_image":
            plan.reference_mode = "required"
        if plan.checkpoint is not None:   # before the queue, naming the argument
            await run_in_threadpool(server.find_checkpoint, plan.checkpoint, "model")
        progress = StepProgress(session)
        outcome = await progress.run(server.generate(plan, McpCall(), progress=progress))
        if outcome is None:
            raise ToolError("the job was dropped")
        body = await run_in_threadpool(a1111.response, plan, outcome)
        info = json.loads(body["info"])
        content: list = []
        for image, seed, text in zip(body["images"], info["all_seeds"], info["infotexts"]):
            content.append(types.ImageContent(data=image, mime_type="image/png"))
            content.append(types.TextContent(text=f"seed {seed}\n{text}"))
        if info["warnings"]:
            content.append(types.TextContent(text="warnings:\n" + "\n".join(info["warnings"])))
        structured = {"seeds": info["all_seeds"], "infotexts": info["infotexts"], "width": info["width"],
                      "height": info["height"], "model": info["sd_model_name"], "warnings": info["warnings"]}
        return types.CallToolResult(content=content, structured_content=structured)

    async def _upscale(self, args: UpscaleArguments) -> types.CallToolResult:
        from ...upscalers.extras import fields_text

        data = await run_in_threadpool(self._image, args.image, args.image_path, "image")
        request = a1111.ExtrasSingleImageRequest(image=data, upscaler_1=args.upscaler, upscaling_resize=args.scale)
        [(result, png)], fields, warnings = await self.server.upscale(request, [("image", data)])
        text = f"{result.width}x{result.height}: {fields_text(fields)}"
        content = [types.ImageContent(data=base64.b64encode(png).decode("ascii"), mime_type="image/png"),
                   types.TextContent(text=text + "".join(f"\nwarning: {w}" for w in warnings))]
        return types.CallToolResult(content=content, structured_content={
            "width": result.width, "height": result.height, "parameters": fields_text(fields), "warnings": warnings})

    async def _list(self, name: str) -> types.CallToolResult:
        data = await run_in_threadpool(self._models if name == "list_models" else _samplers)
        return types.CallToolResult(content=[types.TextContent(text=json.dumps(data))],
                                    structured_content=data)

    def _models(self) -> dict:
        from ...adapters import lora
        from ...upscalers.registry import listing

        server = self.server
        current = server.checkpoints.current
        return {"checkpoints": [{"name": c.model_name, "title": c.title, "current": c.path == current.path}
                                for c in server.checkpoints.list()],
                "upscalers": [{"name": u["name"], "scale": u["scale"]} for u in listing(server.upscaler_dir)],
                "loras": [lora.lora_name(p) for p in lora.list_loras(server.lora_dir)]}


def _samplers() -> dict:
    return {"samplers": [{"name": s["name"], "aliases": s["aliases"],
                          "default_scheduler": s["options"].get("scheduler", "the model's own")}
                         for s in a1111.samplers_list()],
            "schedulers": [s["label"] for s in a1111.schedulers_list()]}
