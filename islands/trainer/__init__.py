"""The trainer: the composition root above generation and evaluation that builds a run from its config and trains
it (loop.py), from parts (parts.py) and reporters (reporters.py)."""

from islands.trainer.loop import train

__all__ = ["train"]
