"""Model definitions."""

from gpu_workers.models.decoder import CausalLM

__all__ = ["CausalLM"]
