"""Whole models built from :mod:`minidist.nn`: ``gpt`` (GPT-2's layout, nanoGPT's names)."""
from minidist.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
