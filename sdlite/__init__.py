"""sdlite: a lean, exact, offline Stable Diffusion inference engine on PyTorch."""
__version__ = "0.1.0"
