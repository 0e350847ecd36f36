"""Helpers every tool shares; a leaf package (it imports nothing of the project)."""
from common.device import device_name, resolve_device
from common.options import OptionError, did_you_mean, from_dict, parse_options, parse_value

__all__ = ["OptionError", "did_you_mean", "from_dict", "parse_options", "parse_value", "device_name", "resolve_device"]
