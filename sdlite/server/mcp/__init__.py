"""MCP (the Model Context Protocol): image tools for agents, over stdio (``sdlite mcp``) and streamable HTTP
(``/mcp`` on ``sdlite serve``).

:mod:`.tools` the tools (their schemas, and each call turned into an A1111 plan on the shared backend);
:mod:`.server` the transports, served by the ``mcp`` SDK's low-level server.
"""
