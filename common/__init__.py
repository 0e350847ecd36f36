"""Helpers every package shares and that import nothing of this project: atomic file writes and JSON-lines reads."""
from common.io import read_jsonl, write_atomic, write_json_atomic, write_text_atomic

__all__ = ["read_jsonl", "write_atomic", "write_json_atomic", "write_text_atomic"]
