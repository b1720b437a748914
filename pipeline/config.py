"""Stage configuration: a documented default TOML, a user TOML on top, then ``--set key=value`` overrides.

The resolved configuration is saved beside the stage's outputs so a run can always be repeated.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

CONFIG_DIR = Path(__file__).resolve().parent


class ConfigError(ValueError):
    """A configuration file or override that cannot be used (the message names it)."""


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def merge(base: dict[str, Any], top: dict[str, Any], where: str) -> dict[str, Any]:
    """``top`` over ``base``; unknown keys are refused so a typo never passes silently."""
    out = copy.deepcopy(base)
    for key, value in top.items():
        if key not in base:
            raise ConfigError(f"{where}: unknown setting {key!r} (known: {', '.join(sorted(base))})")
        if isinstance(base[key], dict):
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: {key!r} must be a table")
            out[key] = merge(base[key], value, f"{where}.{key}" if where else key)
        else:
            out[key] = _coerce(value, base[key], f"{where}.{key}")
    return out


def _coerce(value: Any, like: Any, name: str) -> Any:
    if isinstance(like, bool):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    if isinstance(like, float) and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if like is not None and value is not None and type(value) is not type(like) \
            and not (isinstance(like, int) and isinstance(value, int)):
        raise ConfigError(f"{name} must be {type(like).__name__}, got {value!r}")
    return value


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.epochs=5`` -> (["train", "epochs"], 5); values are read as TOML, else as a string."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.key=value")
    key, raw = text.split("=", 1)
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key.strip().split("."), value


def load_config(default_name: str, user_file: str | os.PathLike[str] | None = None,
                overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Default TOML (shipped in pipeline/) <- user file <- overrides."""
    cfg = read_toml(CONFIG_DIR / default_name)
    if user_file:
        cfg = merge(cfg, read_toml(user_file), str(user_file))
    for text in overrides:
        keys, value = parse_override(text)
        patch: dict[str, Any] = {}
        node = patch
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = value
        cfg = merge(cfg, patch, f"--set {text}")
    return cfg


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise ConfigError(f"cannot write {v!r} to TOML")


def dump_toml(cfg: dict[str, Any]) -> str:
    """TOML text for a two-level config (top-level scalars, then one table per section)."""
    lines = [f"{k} = {_toml_value(v)}" for k, v in cfg.items() if not isinstance(v, dict) and v is not None]
    for section, table in cfg.items():
        if isinstance(table, dict):
            lines += ["", f"[{section}]"]
            lines += [f"{k} = {_toml_value(v)}" for k, v in table.items() if v is not None]
    return "\n".join(lines) + "\n"
