"""kvwall: what remembering the context costs a language model at decode time."""

__version__ = "0.1.0"
