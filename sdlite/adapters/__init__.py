"""What adapts a loaded model to a request without rebuilding it: LoRA (:mod:`sdlite.adapters.lora`, low-rank
weight updates of the UNet and text encoders) and textual inversion (:mod:`sdlite.adapters.embeddings`, learned token
vectors). Above weights, loader, engine and models; below the families and the pipeline."""
