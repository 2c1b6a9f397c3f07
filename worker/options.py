"""`--additional-config`: the `tt` namespace of device options, validated before any device is
touched, with the allowed values named in every refusal."""
from __future__ import annotations

import json
from typing import Any


class OptionError(ValueError):
    """An option value the worker refuses at start-up."""


def _choice(*allowed: str):
    def check(key: str, value: Any) -> Any:
        if value not in allowed:
            raise OptionError(f"tt.{key} = {value!r} is not allowed; choose one of {', '.join(allowed)}")
        return value
    return check


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise OptionError(f"tt.{key} = {value!r} is not a boolean (true or false)")


def _bytes(key: str, value: Any) -> int:
    try:
        size = int(value)
    except (TypeError, ValueError):
        size = -1
    if size <= 0:
        raise OptionError(f"tt.{key} = {value!r} must be a positive number of bytes")
    return size


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise OptionError(f"tt.{key} = {value!r} must be a non-empty name")
    return value


TT_OPTIONS = {
    "sample_on_device_mode": _choice("all", "decode_only"),
    "trace_mode": _choice("all", "decode_only", "none"),
    "enable_model_warmup": _bool,
    "trace_region_size": _bytes,
    "worker_l1_size": _bytes,
    "l1_small_size": _bytes,
    "fabric_config": _text,
    "fabric_reliability_mode": _choice("STRICT_INIT", "RELAXED_INIT"),
    "dispatch_core_axis": _choice("row", "col"),
    "always_compat_sampling": _bool,
    "optimizations": _choice("performance", "accuracy"),
}


def parse_additional_config(text: str | None) -> dict[str, Any]:
    """The validated `tt` options from an `--additional-config` JSON object."""
    if not text:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as e:
        raise OptionError(f"--additional-config is not valid JSON ({e.msg} at column {e.colno})") from e
    if not isinstance(config, dict):
        raise OptionError('--additional-config must be a JSON object, e.g. {"tt": {"trace_mode": "all"}}')
    unknown = set(config) - {"tt"}
    if unknown:
        raise OptionError(f"--additional-config has unknown namespace(s) {', '.join(sorted(unknown))}; "
                          "the worker reads only \"tt\"")
    tt = config.get("tt", {})
    if not isinstance(tt, dict):
        raise OptionError("--additional-config \"tt\" must be a JSON object")
    options = {}
    for key, value in tt.items():
        if key not in TT_OPTIONS:
            raise OptionError(f"unknown option tt.{key}; known options: {', '.join(sorted(TT_OPTIONS))}")
        options[key] = TT_OPTIONS[key](key, value)
    return options
