"""The engine: sequences, their slots and KV pages, the prefill/decode loop and recovery (core.py),
and what each sequence's tokens show (output.py)."""

from .core import Counters, Engine, Event, Handle, PromptProgress, Request, SlotView, Stats

__all__ = ["Counters", "Engine", "Event", "Handle", "PromptProgress", "Request", "SlotView", "Stats"]
