"""Sampling: SamplingParams and Completion, the Engine protocol, the built-in HF engine, the multi-turn driver."""

from .engine import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
