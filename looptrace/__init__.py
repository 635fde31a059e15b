"""looptrace: profile, diff and serve looped language models."""

__version__ = "0.1.0"
