"""Typed options of the command-line tools: a dataclass declares them, one parser reads them.

``parse_options(Schema, argv)`` reads ``key=value`` arguments into the types of ``Schema``'s fields (dotted keys reach
nested dataclass fields); ``from_dict(Schema, mapping)`` checks an already-typed mapping, such as a composed Hydra
config, against the same fields. Every problem is one :class:`OptionError` line that names the key and the fix, e.g.
``widht: unknown key (did you mean 'widths'?)`` or ``force='yes' is not a boolean: write force=true or force=false``.

Spelling on a command line:

- a boolean is ``true`` or ``false``, nothing else (``yes``, ``1`` or ``True`` are refused, never guessed);
- an int may carry a K/M/B/T suffix or an exponent (``50B``, ``1e9``) when its value is whole;
- ``null`` or ``none`` is the value ``None`` of an optional field;
- a list is comma-separated (``widths=64,128``; ``widths=`` is the empty list);
- a ``Literal[...]`` field takes one of its values.

A field's ``metadata={"help": ...}`` is added to the messages about its value.
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import types
from collections.abc import Callable, Iterable, Mapping
from decimal import Decimal, InvalidOperation
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

T = TypeVar("T")
_NONE = ("null", "none")
_INT = re.compile(r"(-?[0-9][0-9_]*(?:\.[0-9_]*)?(?:[eE][+-]?[0-9]+)?)([KMBT]?)")
_SCALE = {"": 1, "K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


class OptionError(ValueError):
    """A bad option or config value; the message is one line that starts with the key."""


def did_you_mean(key: str, names: Iterable[str]) -> str:
    """``"<key>: unknown key"`` with the closest of ``names`` to ``key``'s last dotted part, else the valid keys."""
    names = sorted(set(names))
    close = difflib.get_close_matches(key.rsplit(".", 1)[-1], names, n=1)
    return f"{key}: unknown key" + (f" (did you mean {close[0]!r}?)" if close else
                                    f" (valid keys: {', '.join(names)})")


def field_types(schema: type) -> dict[str, Any]:
    """``{field name: resolved type}`` of the dataclass ``schema``, in declaration order."""
    hints = get_type_hints(schema)
    return {f.name: hints[f.name] for f in dataclasses.fields(schema)}


def _help(schema: type, name: str) -> str:
    f = next(f for f in dataclasses.fields(schema) if f.name == name)
    return f" ({f.metadata['help']})" if "help" in f.metadata else ""


def _is_union(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType)


def describe(hint: Any) -> str:
    """What a value of type ``hint`` is, in words: ``an int``, ``null or a string``, ``one of 'a', 'b'``."""
    if _is_union(hint):
        return " or ".join("null" if a is type(None) else describe(a) for a in get_args(hint))
    if get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(hint))
    if get_origin(hint) is list:
        return f"a list of {describe(get_args(hint)[0]).removeprefix('a ').removeprefix('an ')}"
    return {bool: "a boolean (true or false)", int: "an int", float: "a float", str: "a string"}.get(
        hint, getattr(hint, "__name__", str(hint)))


def _int(text: str) -> int:
    m = _INT.fullmatch(text)
    if not m:
        raise ValueError(text)
    try:
        value = Decimal(m.group(1).replace("_", "")) * _SCALE[m.group(2)]
    except InvalidOperation:
        raise ValueError(text) from None
    if value != value.to_integral_value():
        raise ValueError(text)
    return int(value)


def parse_value(key: str, hint: Any, text: str) -> Any:
    """``text`` (a command line's value of ``key``) as a value of type ``hint``; a one-line :class:`OptionError`
    naming the key, the value and the type otherwise."""
    origin = get_origin(hint)
    if hint is Any:
        return text
    if _is_union(hint):
        args = get_args(hint)
        if type(None) in args and text.lower() in _NONE:
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return parse_value(key, arm, text)
            except OptionError:
                continue
        raise OptionError(f"{key}={text!r} is not {describe(hint)}")
    if origin is list:
        item = get_args(hint)[0]
        try:
            return [parse_value(key, item, x.strip()) for x in text.split(",") if x.strip()]
        except OptionError:
            raise OptionError(f"{key}={text!r} is not a comma-separated list of "
                              f"{describe(item).removeprefix('a ').removeprefix('an ')}") from None
    if origin is Literal:
        if text not in get_args(hint):
            close = difflib.get_close_matches(text, [str(a) for a in get_args(hint)], n=1)
            raise OptionError(f"{key}={text!r} is not {describe(hint)}"
                              + (f" (did you mean {close[0]!r}?)" if close else ""))
        return text
    if hint is bool:
        if text not in ("true", "false"):
            raise OptionError(f"{key}={text!r} is not a boolean: write {key}=true or {key}=false")
        return text == "true"
    if hint is int:
        try:
            return _int(text)
        except ValueError:
            raise OptionError(f"{key}={text!r} is not an int (e.g. 1000, 1e9, 50B)") from None
    if hint is float:
        try:
            return float(text)
        except ValueError:
            raise OptionError(f"{key}={text!r} is not a float (e.g. 0.5, 3e-4)") from None
    if hint is str:
        return text
    raise TypeError(f"{key}: the options parser does not read fields of type {hint!r}")


def _schema_of(hint: Any) -> type | None:
    """The dataclass a field of type ``hint`` holds (``X`` or ``X | None``), else ``None``."""
    if _is_union(hint):
        arms = [a for a in get_args(hint) if a is not type(None)]
        hint = arms[0] if len(arms) == 1 else None
    return hint if isinstance(hint, type) and dataclasses.is_dataclass(hint) else None


def parse_options(schema: type, argv: Iterable[str], *, passthrough: Callable[[str], bool] | None = None,
                  other_names: Iterable[str] = (), example: str = "") -> tuple[dict[str, Any], list[str]]:
    """Read ``key=value`` arguments into the field types of the dataclass ``schema``.

    Args:
        schema: the dataclass whose fields are the options; a dotted key reaches a nested dataclass field.
        argv: the arguments; a key may start with ``+`` or ``--`` (``+seed=3``, ``--widths=64``).
        passthrough: keys (without ``+``) this tool hands on to another program (an argument whose key it accepts
            is returned as given, in order).
        other_names: further valid first key parts (the other program's), offered by the did-you-mean.
        example: an argument shown when one is not ``key=value``.
    Returns:
        ``(values, rest)``: ``{field: value}`` of the arguments given (nested dicts for nested fields; a key given
        twice keeps its last value) and the passed-through arguments.
    Raises:
        OptionError: an argument without ``=``, an unknown key, or a value not of its field's type.
    """
    values: dict[str, Any] = {}
    rest: list[str] = []
    names = field_types(schema)
    example = example or next(f"{f.name}={f.default}" for f in dataclasses.fields(schema)
                              if f.default is not dataclasses.MISSING)
    for arg in argv:
        key, sep, text = arg.partition("=")
        key = key.removeprefix("--").lstrip("+")
        if not sep:
            raise OptionError(f"{arg!r}: arguments are key=value (e.g. {example})")
        parts = key.split(".")
        if parts[0] not in names and passthrough is not None and passthrough(key):
            rest.append(arg)
            continue
        node, into, hints = schema, values, names
        for i, part in enumerate(parts):
            if part not in hints:
                raise OptionError(did_you_mean(".".join(parts[:i + 1]),
                                               [*hints, *(other_names if i == 0 else ())]))
            sub = _schema_of(hints[part])
            if i == len(parts) - 1:
                if sub is not None:
                    raise OptionError(f"{key}: is a group of options; set one of them, e.g. "
                                      f"{key}.{dataclasses.fields(sub)[0].name}=...")
                try:
                    into[part] = parse_value(key, hints[part], text)
                except OptionError as e:
                    raise OptionError(f"{e}{_help(node, part)}") from None
            elif sub is None:
                raise OptionError(f"{key}: {'.'.join(parts[:i + 1])} is a single value, not a group of options")
            else:
                node, into, hints = sub, into.setdefault(part, {}), field_types(sub)
    return values, rest


def _check(key: str, hint: Any, value: Any) -> Any:
    """``value`` if it is of type ``hint`` (an int stands for a float; a nested mapping becomes its dataclass),
    else :class:`OptionError`."""
    sub = _schema_of(hint)
    if sub is not None and isinstance(value, Mapping):
        return from_dict(sub, value, prefix=f"{key}.")
    if hint is Any:
        return value
    if _is_union(hint):
        for arm in get_args(hint):
            if arm is type(None):
                if value is None:
                    return None
                continue
            try:
                return _check(key, arm, value)
            except OptionError:
                continue
    elif get_origin(hint) is list:
        if isinstance(value, (list, tuple)):
            return [_check(f"{key}[{i}]", get_args(hint)[0], v) for i, v in enumerate(value)]
    elif get_origin(hint) is dict:
        if isinstance(value, Mapping):
            return dict(value)
    elif get_origin(hint) is Literal:
        if value in get_args(hint):
            return value
        close = difflib.get_close_matches(str(value), [str(a) for a in get_args(hint)], n=1)
        raise OptionError(f"{key}: {value!r} is not {describe(hint)}" + (f" (did you mean {close[0]!r}?)" if close
                                                                         else ""))
    elif hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif hint in (bool, int, str):
        if isinstance(value, hint) and not (hint is int and isinstance(value, bool)):
            return value
    else:
        raise TypeError(f"{key}: cannot check fields of type {hint!r}")
    raise OptionError(f"{key}: {value!r} is not {describe(hint)}")


def from_dict(schema: type[T], data: Mapping[str, Any], *, prefix: str = "") -> T:
    """The dataclass ``schema`` built from ``data`` (nested mappings for nested dataclass fields), each value
    checked against its field's type and missing ones at their defaults.

    Raises:
        OptionError: ``ruler.haystack: 123 is not a string (kjv, essays, ...)``, or an unknown key with a
            did-you-mean; the key is dotted from ``prefix``.
    """
    hints = field_types(schema)
    for key in data:
        if key not in hints:
            raise OptionError(did_you_mean(f"{prefix}{key}", hints))
    kwargs = {}
    for name, value in data.items():
        try:
            kwargs[name] = _check(f"{prefix}{name}", hints[name], value)
        except OptionError as e:
            raise OptionError(f"{e}{_help(schema, name)}" if _schema_of(hints[name]) is None else str(e)) from None
    missing = [f.name for f in dataclasses.fields(schema) if f.name not in kwargs and
               f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise OptionError(f"{prefix}{missing[0]}: missing; give {prefix}{missing[0]}=...{_help(schema, missing[0])}")
    return schema(**kwargs)
