"""Helpers every tool shares; a leaf package (it imports nothing of the project): atomic file writes, JSON-lines
reads, typed ``key=value`` options and device resolution."""
from common.device import device_name, resolve_device
from common.io import read_jsonl, write_atomic, write_json_atomic, write_text_atomic
from common.options import OptionError, did_you_mean, from_dict, parse_options, parse_value

__all__ = ["OptionError", "device_name", "did_you_mean", "from_dict", "parse_options", "parse_value", "read_jsonl",
           "resolve_device", "write_atomic", "write_json_atomic", "write_text_atomic"]
