"""`--additional-config`: the `tt` namespace of device options, validated before any device is
touched, with the allowed values named in every refusal.

Users write the options in either of the two forms vLLM accepts, or both:

    --additional-config '{"tt": {"trace_mode": "decode_only"}}'
    --additional-config.tt.trace_mode decode_only   (or --additional-config.tt.trace_mode=decode_only)

`split_additional_config` takes the dotted form out of argv before argparse sees it;
`parse_additional_config` merges it over the JSON form (dotted wins per key) and validates both
through the same table, `TT_OPTIONS`.
"""
from __future__ import annotations

import difflib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .mesh import FABRIC_CONFIGS

log = logging.getLogger(__name__)

FLAG = "--additional-config"
DEFAULT_TRACE_REGION_SIZE = 50_000_000  # bytes, when any step kind is traced


class OptionError(ValueError):
    """An option value the worker refuses at start-up."""


def _choice(*allowed: str) -> Callable[[str, Any], str]:
    def check(key: str, value: Any) -> str:
        if value not in allowed:
            raise OptionError(f"tt.{key} = {value!r} is not allowed; choose one of {', '.join(allowed)}")
        return value
    return check


def _bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise OptionError(f"tt.{key} = {value!r} is not a boolean (true or false)")


_SIZE = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG])$")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30}


def _bytes(key: str, value: Any) -> int:
    """A positive byte count: an integer, or a string with vLLM's suffixes (50m = 50e6, 1K = 1024)."""
    size = -1
    if isinstance(value, bool):
        pass
    elif isinstance(value, int):
        size = value
    elif isinstance(value, float) and value.is_integer():
        size = int(value)
    elif isinstance(value, str):
        text = value.strip()
        match = _SIZE.match(text)
        if text.isdigit():
            size = int(text)
        elif match and match.group(2) in _DECIMAL:
            size = int(float(match.group(1)) * _DECIMAL[match.group(2)])
        elif match and match.group(1).isdigit():
            size = int(match.group(1)) * _BINARY[match.group(2)]
    if size <= 0:
        raise OptionError(f"tt.{key} = {value!r} must be a positive number of bytes "
                          "(e.g. 50000000, 50m or 48M)")
    return size


def _multi_rank_launch(key: str, value: Any) -> Any:
    """The plugin's tt-run/MPI launch of engine ranks (its launcher.py), which ttserve does not do."""
    raise OptionError(
        f"tt.{key} = {value!r} configures the TT vLLM plugin's multi-rank launch (tt-run over MPI, one engine rank "
        "per submesh or host); ttserve runs one worker per host or submesh instead: start "
        "`ttserve worker` on each (with its TT_VISIBLE_DEVICES) and pass each to the control plane "
        "with --worker HOST:PORT. Remove tt.rank_binding, tt.mpi_args and tt.extra_ttrun_args")


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise OptionError(f"tt.{key} = {value!r} must be a non-empty string (a path)")
    return value


def _patterns(key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise OptionError(f"tt.{key} = {value!r} must be a list of environment-variable patterns, "
                          'e.g. ["VLLM_*", "MESH_DEVICE"]')
    return list(value)


# Accepted for the plugin's launch configuration, with no effect on a ttserve worker (which reads
# its own environment and is started by its own supervisor).
LAUNCH_ONLY_OPTIONS = ("config_pkl_dir", "env_passthrough")

TT_OPTIONS: dict[str, Callable[[str, Any], Any]] = {
    "sample_on_device_mode": _choice("all", "decode_only"),
    "trace_mode": _choice("all", "decode_only", "none"),
    "enable_model_warmup": _bool,
    "trace_region_size": _bytes,
    "worker_l1_size": _bytes,
    "l1_small_size": _bytes,
    "fabric_config": _choice(*FABRIC_CONFIGS),
    "fabric_reliability_mode": _choice("STRICT_INIT", "RELAXED_INIT", "DYNAMIC_RECONFIG"),
    "dispatch_core_axis": _choice("row", "col"),
    "always_compat_sampling": _bool,
    "optimizations": _choice("performance", "accuracy"),
    # Registers tt-metal's dummy test models (models.vllm_test_utils), as the plugin does.
    "register_test_models": _bool,
    "rank_binding": _multi_rank_launch,
    "mpi_args": _multi_rank_launch,
    "extra_ttrun_args": _multi_rank_launch,
    "config_pkl_dir": _text,
    "env_passthrough": _patterns,
}


# ---- the two command-line forms ----------------------------------------------------------------

def split_additional_config(argv: list[str]) -> tuple[list[str], dict[str, Any]]:
    """Takes every `--additional-config.NS.KEY VALUE` (or `=VALUE`) out of argv.

    Returns the remaining arguments, for argparse, and the dotted options as one nested dict,
    e.g. {"tt": {"trace_mode": "all"}}. Values are JSON where they parse (true, 3, "x", {...}),
    plain strings otherwise, as vLLM's parser does. Nothing is validated here.
    """
    rest: list[str] = []
    dotted: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":  # everything after it is positional
            rest += argv[i:]
            break
        name = arg.split("=", 1)[0]
        prefix = next((p for p in (FLAG + ".", "--additional_config.") if name.startswith(p)), None)
        if prefix is None:
            rest.append(arg)
            i += 1
            continue
        if "=" in arg:
            text = arg.split("=", 1)[1]
            i += 1
        elif i + 1 < len(argv):
            text = argv[i + 1]
            i += 2
        else:
            raise OptionError(f"{arg} needs a value, e.g. {arg} all")
        keys = name[len(prefix):].split(".")
        if not all(keys):
            raise OptionError(f"{name} is not of the form {FLAG}.tt.KEY")
        _set_nested(dotted, keys, _value(text))
    return rest, dotted


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _set_nested(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        node = target.setdefault(key, {})
        if not isinstance(node, dict):
            raise OptionError(f"{FLAG}.{'.'.join(keys)} conflicts with an earlier value of "
                              f"{FLAG}.{key}")
        target = node
    if keys[-1] in target:
        log.warning("%s.%s given twice; the last value wins", FLAG, ".".join(keys))
    if isinstance(value, dict) and isinstance(target.get(keys[-1]), dict):
        target[keys[-1]].update(value)
    else:
        target[keys[-1]] = value


# ---- validation ----------------------------------------------------------------------------------

def parse_additional_config(text: str | None, dotted: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The validated `tt` options from the JSON `--additional-config` and the dotted flags.

    A key given both ways takes the dotted value.
    """
    config: dict[str, Any] = {}
    if text:
        try:
            config = json.loads(text)
        except json.JSONDecodeError as e:
            raise OptionError(f"{FLAG} is not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(config, dict):
            raise OptionError(f'{FLAG} must be a JSON object, e.g. {{"tt": {{"trace_mode": "all"}}}}')
    for namespace, value in (dotted or {}).items():
        if isinstance(value, dict) and isinstance(config.get(namespace), dict):
            overridden = sorted(set(value) & set(config[namespace]))
            if overridden:
                log.info("%s.%s.{%s} override the JSON %s", FLAG, namespace, ",".join(overridden), FLAG)
            config[namespace] = {**config[namespace], **value}
        else:
            config[namespace] = value
    return validate_additional_config(config)


def validate_additional_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The validated `tt` options of a whole `--additional-config` object (both forms end here)."""
    unknown = set(config) - {"tt"}
    if unknown:
        raise OptionError(f"{FLAG} has unknown namespace(s) {', '.join(sorted(unknown))}; "
                          "the worker reads only \"tt\"")
    tt = config.get("tt", {})
    if not isinstance(tt, dict):
        raise OptionError(f"{FLAG} \"tt\" must be an object of options, e.g. "
                          f"{FLAG}.tt.trace_mode all")
    options = {}
    for key, value in tt.items():
        if key not in TT_OPTIONS:
            close = difflib.get_close_matches(key, TT_OPTIONS, n=1)
            hint = f" (did you mean tt.{close[0]}?)" if close else ""
            raise OptionError(f"unknown option tt.{key}{hint}; known options: {', '.join(sorted(TT_OPTIONS))}")
        options[key] = TT_OPTIONS[key](key, value)
    return options


# ---- what the options mean for the runner ------------------------------------------------------

@dataclass(frozen=True, slots=True)
class TraceFlags:
    """`enable_trace` per step kind."""
    prefill: bool
    decode: bool

    @property
    def any(self) -> bool:
        return self.prefill or self.decode


def trace_flags(options: Mapping[str, Any]) -> TraceFlags:
    mode = options.get("trace_mode", "all")
    return TraceFlags(prefill=mode == "all", decode=mode in ("all", "decode_only"))


def device_sampling(options: Mapping[str, Any], step_kind: str) -> bool:
    """Whether steps of `step_kind` ("prefill" | "decode") may sample on the device at all.

    The per-batch decision (logprobs, penalties, grammar, ...) is the runner's; this is the
    ceiling the options set.
    """
    if options.get("always_compat_sampling", False):
        return False
    mode = options.get("sample_on_device_mode")
    return mode == "all" or (mode == "decode_only" and step_kind == "decode")


def check_model_options(options: Mapping[str, Any], capabilities: Mapping[str, Any],
                        model_name: str) -> list[str]:
    """Refuses options the model cannot honour; returns warnings for ones that have no effect."""
    if options.get("sample_on_device_mode") and not capabilities.get("supports_sample_on_device"):
        raise OptionError(f"tt.sample_on_device_mode = {options['sample_on_device_mode']!r}, but "
                          f"{model_name} does not support sampling on the device; unset it or "
                          "use a model that declares supports_sample_on_device")
    warnings = []
    if options.get("sample_on_device_mode") and options.get("always_compat_sampling"):
        warnings.append("tt.always_compat_sampling is true: every batch samples on the host, so "
                        "tt.sample_on_device_mode has no effect")
    for key in LAUNCH_ONLY_OPTIONS:
        if key in options:
            warnings.append(f"tt.{key} has no effect: it configures the TT vLLM plugin's tt-run launch, "
                            "and a ttserve worker reads its own environment")
    if "trace_region_size" in options and not trace_flags(options).any:
        warnings.append("tt.trace_region_size is ignored with tt.trace_mode = 'none'")
    return warnings


def async_decode_allowed(options: Mapping[str, Any], capabilities: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether decode steps may overlap (launch N+1 before N is read back), and why not.

    The overlap needs the model's split decode (supports_async_decode), traced decode, and
    device sampling for decode (the next step's inputs are the device-resident tokens).
    """
    if not capabilities.get("supports_async_decode"):
        return False, "the model does not declare supports_async_decode"
    if not trace_flags(options).decode:
        return False, "async decode needs traced decode; tt.trace_mode is 'none'"
    if not device_sampling(options, "decode"):
        return False, ("async decode needs device sampling; set tt.sample_on_device_mode "
                       "(and leave tt.always_compat_sampling off)")
    return True, "model, trace_mode and sample_on_device_mode allow it"
