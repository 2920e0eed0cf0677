"""ComfyUI's API (``/prompt``, ``/ws``, ``/history``, ``/object_info`` ...) and its own web page at ``/comfy/``.

:mod:`.routes` the HTTP routes and the websocket; :mod:`.queue` the prompt queue and its history over the server's
one job queue; :mod:`.workflow` validates a workflow and runs its nodes; :mod:`.nodes` the node catalog (inputs,
values, what sdlite refuses), :mod:`.modelsampling` how ComfyUI samples each model, :mod:`.loaders` the separate-file
loaders, and the nodes of the families' stock workflows (:mod:`.zimage`, :mod:`.flux2`, :mod:`.kontext`,
:mod:`.qwenimage`); :mod:`.images` ComfyUI's image tensors, files and masks; :mod:`.frontend` the
``comfyui-frontend-package`` page and the routes it needs.
"""
