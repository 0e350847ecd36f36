"""Backbones and baseline mixers (filled by the models work, issue 4)."""
