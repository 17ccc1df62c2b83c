"""Model loading, LoRA, log-prob utilities and the tiny model builder."""
