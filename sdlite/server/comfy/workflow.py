"""ComfyUI's API-format workflows on sdlite: the node catalog as ``/object_info`` gives it, validation with ComfyUI's
error shapes, and execution node by node with ComfyUI's output cache.

A workflow (ComfyUI's "API format") maps node ids to ``{"class_type": ..., "inputs": {...}}``; an input is a literal
or a link ``[node_id, output_index]``. :func:`validate` checks it as ComfyUI's ``validate_prompt`` does and answers
with the output nodes to run, or raises :class:`PromptError` carrying ComfyUI's 400 body. :class:`Executor` runs a
validated workflow in the job queue's worker thread: each node needed by an output node once, in dependency order,
its outputs kept between prompts under a key of its class and inputs (through its upstream nodes), so a workflow
queued again with only a new seed re-runs only the sampler and what follows it.

The nodes are :mod:`.nodes`' (their inputs, values and what sdlite refuses); the sampler nodes run sdlite's
engine with ComfyUI's KSampler conventions (:mod:`sdlite.pipeline.latents`, ``Request(noise="comfy")``).

Differences from ComfyUI that remain:

* validation refuses the whole prompt when any output node fails (ComfyUI runs the outputs that pass);
* only the latest prompt's node outputs are kept (ComfyUI's default "classic" cache keeps the same);
* the errors of nodes sdlite cannot honour are ``custom_validation_failed`` errors naming node, input and value.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ...errors import StopSampling
from . import custom, flux2, kontext, loaders, qwenimage, zimage  # noqa: F401  (importing them registers their nodes)
from . import nodes as comfy_nodes
from .nodes import NODES, Context, NodeDef, Refused

__all__ = ["PromptError", "ComfyDirs", "Interrupted", "object_info", "validate", "Executor"]


class PromptError(Exception):
    """A workflow ``/prompt`` refuses: ComfyUI's 400 body is ``{"error": self.error, "node_errors":
    self.node_errors}``."""

    def __init__(self, error: dict, node_errors: dict | None = None):
        super().__init__(error.get("message", "invalid prompt"))
        self.error = error
        self.node_errors = node_errors or {}

    def body(self) -> dict:
        return {"error": self.error, "node_errors": self.node_errors}


class Interrupted(Exception):
    """The job was interrupted (``/interrupt``, a client gone, the server's time limit): the workflow stopped."""


@dataclass
class ComfyDirs:
    """ComfyUI's folders: LoadImage reads ``input``, SaveImage writes ``output``, PreviewImage ``temp``."""

    input: Path
    output: Path
    temp: Path

    def __post_init__(self):
        self.input, self.output, self.temp = Path(self.input), Path(self.output), Path(self.temp)


def _dirs_of(server, dirs: ComfyDirs | None) -> ComfyDirs | None:
    return dirs if dirs is not None else getattr(server, "comfy_dirs", None)


# --- /object_info ---------------------------------------------------------------------------------------------

def object_info(server, dirs: ComfyDirs | None = None) -> dict:
    """``GET /object_info``: every node sdlite runs, as ComfyUI describes it, with the combo lists of this server
    (checkpoints, LoRAs, upscalers, ControlNets, input images, samplers, schedulers)."""
    lists = comfy_nodes.Lists(server, _dirs_of(server, dirs))
    return {name: node.info(lists) for name, node in NODES.items()}


# --- validation -----------------------------------------------------------------------------------------------

def _error(kind: str, message: str, details: str = "", **extra_info) -> dict:
    return {"type": kind, "message": message, "details": details, "extra_info": extra_info}


def _is_link(value) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int) \
        and not isinstance(value[1], bool)


def validate(prompt: Any, server, dirs: ComfyDirs | None = None) -> list[str]:
    """The ids of the output nodes to run; raises :class:`PromptError` with ComfyUI's error shapes: an unknown
    class or a node without one (``invalid_prompt``), no output node (``prompt_no_outputs``), bad inputs
    (``prompt_outputs_failed_validation`` with ``node_errors``: missing inputs, links of the wrong type, values out
    of range or not in a list, what sdlite cannot honour)."""
    if not isinstance(prompt, dict):
        raise PromptError(_error("invalid_prompt", "Cannot execute because the prompt is not an object of nodes.",
                                 f"got {type(prompt).__name__}"))
    for node_id, node in prompt.items():
        if not isinstance(node, dict) or "class_type" not in node:
            raise PromptError(_error("invalid_prompt",
                                     "Cannot execute because a node is missing the class_type property.",
                                     f"Node ID '#{node_id}'"))
        class_type = node["class_type"]
        if not isinstance(class_type, str) or class_type not in NODES:
            raise PromptError(_error("invalid_prompt", f"Cannot execute because node {class_type} does not exist.",
                                     f"Node ID '#{node_id}'"))
        if not isinstance(node.get("inputs", {}), dict):
            raise PromptError(_error("invalid_prompt", "Cannot execute because a node's inputs are not an object.",
                                     f"Node ID '#{node_id}'"))
    outputs = [node_id for node_id, node in prompt.items() if NODES[node["class_type"]].output_node]
    if not outputs:
        raise PromptError(_error("prompt_no_outputs", "Prompt has no outputs"))
    cycle = _cycle(prompt)
    if cycle is not None:
        raise PromptError(_error("invalid_prompt", "Dependency cycle detected",
                                 "Node ID '#" + "' -> '#".join(cycle) + "'"))
    lists = comfy_nodes.Lists(server, _dirs_of(server, dirs))
    checked: dict[str, list] = {}
    node_errors: dict[str, dict] = {}
    for out in outputs:
        for node_id in _upstream(prompt, out, checked_links=True):
            if node_id not in checked:
                checked[node_id] = _validate_node(prompt, node_id, lists)
    for out in outputs:
        for node_id in _upstream(prompt, out, checked_links=True):
            errors = checked.get(node_id) or []
            if errors:
                entry = node_errors.setdefault(node_id, {"errors": errors, "dependent_outputs": [],
                                                         "class_type": prompt[node_id]["class_type"]})
                if out not in entry["dependent_outputs"]:
                    entry["dependent_outputs"].append(out)
    if node_errors:
        lines = [f"{prompt[n]['class_type']} {n}: " + "; ".join(f"{e['message']}: {e['details']}"
                                                               for e in v["errors"]) for n, v in node_errors.items()]
        raise PromptError(_error("prompt_outputs_failed_validation", "Prompt outputs failed validation",
                                 "\n".join(lines)), node_errors)
    return outputs


def _cycle(prompt: dict) -> list[str] | None:
    """A dependency cycle among the nodes (a list of node ids, its first repeated at the end), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    for root in prompt:
        if root in state:
            continue
        path, stack = [], [(root, iter(_sources(prompt, root)))]
        state[root] = 1
        path.append(root)
        while stack:
            current, sources = stack[-1]
            source = next(sources, None)
            if source is None:
                stack.pop()
                path.pop()
                state[current] = 2
            elif state.get(source) == 1:
                return path[path.index(source):] + [source]
            elif source not in state:
                state[source] = 1
                path.append(source)
                stack.append((source, iter(_sources(prompt, source))))
    return None


def _sources(prompt: dict, node_id: str) -> list[str]:
    return [v[0] for v in prompt[node_id].get("inputs", {}).values() if _is_link(v) and v[0] in prompt]


def _upstream(prompt: dict, node_id: str, checked_links: bool = False) -> list[str]:
    """``node_id`` and every node it depends on (links to missing nodes skipped: the node's validation names
    them), each once, dependencies first."""
    order: list[str] = []
    seen: set[str] = set()
    stack = [(node_id, False)]
    while stack:
        current, expanded = stack.pop()
        if expanded:
            order.append(current)
            continue
        if current in seen:
            continue
        seen.add(current)
        stack.append((current, True))
        for value in prompt[current].get("inputs", {}).values():
            if _is_link(value) and value[0] in prompt and value[0] not in seen:
                stack.append((value[0], False))
    return order


def _validate_node(prompt: dict, node_id: str, lists) -> list[dict]:
    node = prompt[node_id]
    spec: NodeDef = NODES[node["class_type"]]
    inputs = node.get("inputs", {})
    errors: list[dict] = []
    values: dict[str, Any] = {}
    for name, inp in spec.inputs.items():
        config = inp.info(lists)
        if name not in inputs:
            if inp.required:
                errors.append(_error("required_input_missing", "Required input is missing", name,
                                     input_name=name))
            continue
        value = inputs[name]
        if isinstance(value, list) and not inp.is_value:
            if not _is_link(value):
                errors.append(_error("bad_linked_input", "Bad linked input, must be a length-2 list of "
                                     "[node_id, slot_index]", f"{name}, {value!r}", input_name=name,
                                     input_config=config, received_value=value))
                continue
            source_id, slot = value
            if source_id not in prompt:
                errors.append(_error("bad_linked_input", "Bad linked input: the node it links to does not exist",
                                     f"{name}, node {source_id!r}", input_name=name, input_config=config,
                                     received_value=value))
                continue
            source = NODES[prompt[source_id]["class_type"]]
            if not 0 <= slot < len(source.outputs):
                errors.append(_error("bad_linked_input", "Bad linked input: the output it links to does not exist",
                                     f"{name}, output {slot} of node {source_id} ({source.name}: "
                                     f"{len(source.outputs)} outputs)", input_name=name, input_config=config,
                                     received_value=value))
                continue
            received = source.outputs[slot]
            if received != inp.type:
                errors.append(_error("return_type_mismatch", "Return type mismatch between linked nodes",
                                     f"{name}, received_type({received}) mismatch input_type({inp.type})",
                                     input_name=name, input_config=config, received_type=received,
                                     linked_node=value))
            continue
        if not inp.is_value:
            errors.append(_error("bad_linked_input", "Bad linked input, must be a length-2 list of [node_id, "
                                 "slot_index]", f"{name}, {value!r}: a {inp.type} comes from another node's output",
                                 input_name=name, input_config=config, received_value=value))
            continue
        problem = inp.check(value, lists)
        if problem is not None:
            kind, message, details = problem
            errors.append(_error(kind, message, f"{name}: {details}" if details else name, input_name=name,
                                 input_config=config, received_value=value))
            continue
        values[name] = inp.convert(value)
    if not errors and spec.refuse is not None:
        try:
            spec.refuse(values, lists)
        except Refused as e:
            errors.append(_error("custom_validation_failed", "Custom validation failed for node",
                                 f"{e.input} - {e}", input_name=e.input, received_value=values.get(e.input)))
    return errors


# --- execution ------------------------------------------------------------------------------------------------

class Executor:
    """Runs validated workflows in the job queue's worker thread; keeps node outputs between prompts."""

    def __init__(self, server, dirs: ComfyDirs):
        self.server, self.dirs = server, dirs
        server.comfy_dirs = dirs   # validation and /object_info list the input folder's images
        self._cache: dict[Any, tuple] = {}
        self.executed: list[str] = []   # the node ids the last run executed (not taken from the cache)

    def _signature(self, prompt: dict, node_id: str, memo: dict, lists) -> Any:
        """The cache key of a node: its class and its inputs, a link by its source's key and output index."""
        if node_id in memo:
            return memo[node_id]
        node = prompt[node_id]
        spec = NODES[node["class_type"]]
        items = []
        for name, value in sorted(node.get("inputs", {}).items()):
            if name not in spec.inputs:
                continue   # ComfyUI passes unknown inputs by; they change nothing here
            if _is_link(value) and not spec.inputs[name].is_value:
                items.append((name, ("link", self._signature(prompt, value[0], memo, lists), value[1])))
            else:
                items.append((name, json.dumps(value, sort_keys=True)))
        changed = spec.changed(node.get("inputs", {}), lists) if spec.changed is not None else None
        memo[node_id] = (spec.name, tuple(items), changed)
        return memo[node_id]

    def run(self, prompt_id: str, prompt: dict, outputs: list[str], control, emit: Callable[[str, dict], None],
            extra_data: dict | None = None) -> dict:
        """Execute the workflow's ``outputs`` (from :func:`validate`). ``control`` is the job's JobControl
        (interrupt, progress); ``emit(event, data)`` gets ComfyUI's "execution_start", "execution_cached",
        "executing", "progress", "executed" and "preview" ({"image": PIL image}). ``extra_data``: the ``/prompt``
        body's ``extra_data`` (its ``extra_pnginfo``, e.g. the workflow, goes into saved PNGs as ComfyUI writes
        it). Returns the history's "outputs": ``{node_id: {"images": [...]}}``. Raises :class:`Interrupted` when
        the job is interrupted, else the error of the failing node."""
        lists = comfy_nodes.Lists(self.server, self.dirs)
        emit("execution_start", {"prompt_id": prompt_id})
        order: list[str] = []
        for out in outputs:
            order += [n for n in _upstream(prompt, out) if n not in order]
        memo: dict = {}
        keys = {node_id: self._signature(prompt, node_id, memo, lists) for node_id in order}
        cached = [n for n in order if keys[n] in self._cache]
        emit("execution_cached", {"nodes": cached, "prompt_id": prompt_id})
        ctx = Context(server=self.server, dirs=self.dirs, control=control, prompt=prompt, prompt_id=prompt_id,
                      extra_pnginfo=(extra_data or {}).get("extra_pnginfo"), emit=emit)
        results: dict[str, tuple] = {}
        history: dict[str, dict] = {}
        fresh: dict[Any, tuple] = {}
        self.executed = []
        try:
            for node_id in order:
                if getattr(control, "interrupted", False):
                    raise Interrupted("interrupted")
                spec = NODES[prompt[node_id]["class_type"]]
                if node_id in cached:   # as ComfyUI: a cached output node reports its output again
                    ui, results[node_id] = fresh[keys[node_id]] = self._cache[keys[node_id]]
                    if ui is not None:
                        history[node_id] = ui
                        emit("executed", {"node": node_id, "display_node": node_id, "output": ui,
                                          "prompt_id": prompt_id})
                    continue
                emit("executing", {"node": node_id, "display_node": node_id, "prompt_id": prompt_id})
                args = {}
                for name, value in prompt[node_id].get("inputs", {}).items():
                    inp = spec.inputs.get(name)
                    if inp is None:
                        continue
                    if _is_link(value) and not inp.is_value:
                        args[name] = results[value[0]][value[1]]
                    else:
                        args[name] = inp.convert(value)
                for name, inp in spec.inputs.items():
                    if name not in args and inp.default is not None:
                        args[name] = inp.default
                ctx.node_id = node_id
                try:
                    out = spec.run(ctx, **args)
                except StopSampling:
                    raise Interrupted("interrupted") from None
                except Exception as e:
                    e.node_id = node_id   # which node failed, for the execution_error event
                    raise
                self.executed.append(node_id)
                ui, values = (out if spec.output_node else (None, out))
                results[node_id] = values
                fresh[keys[node_id]] = (ui, values)
                if ui is not None:
                    history[node_id] = ui
                    emit("executed", {"node": node_id, "display_node": node_id, "output": ui,
                                      "prompt_id": prompt_id})
        finally:
            # ComfyUI's classic cache: what this prompt computed (and reused) is kept until the next prompt
            self._cache = {**{k: v for k, v in self._cache.items() if k in fresh}, **fresh} if fresh else self._cache
        return history

    def free(self, unload_models: bool, free_memory: bool) -> None:
        """``POST /free``: either flag forgets the cached node outputs (the tensors they hold) and the merged LoRA
        layers the engines keep for a next request with the same LoRAs. The loaded models stay: the server's engine
        cache keeps its ``sd_checkpoints_limit`` models and loads another on demand."""
        if free_memory or unload_models:
            self._cache = {}
            self.server.engines.forget_kept_loras()
