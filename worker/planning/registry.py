"""Model registry: a checkpoint's declared architecture selects the model class (docs/architecture.md, "The worker").

Entries are named `TT<HFArch>` (TTLlamaForCausalLM, ...) and match the architectures a checkpoint
declares in config.json, never its name, so one entry covers every release of a family. The first
declared architecture with an entry wins.

Where entries come from:

* Built-in, per backend. `torch`: ttserve's reference models (ttserve.worker.backends.torch.models). `ttnn`:
  tt-metal's model classes, held as lazy "module:Class" strings and imported only when selected,
  so a host without tt-metal can still list them. `TT_LLAMA_TEXT_VER` and `TT_QWEN3_TEXT_VER`
  switch the Llama and Qwen3 entries to tt-metal's Galaxy implementations; `TT_QWEN35_TEXT_VER`
  names the Qwen 3.5 implementation (only `qwen36_blackhole` exists).
  `TT_VLLM_BUILTIN_MODELS=0` (or false/no/off) drops the built-ins.
* Bundles under `EXTRA_MODELS_DIR` (one folder, or several joined with os.pathsep): every
  sub-folder is a bundle holding `vllm_metadata.json` -- `{"arch": "<HFArch>" or "TT<HFArch>",
  "main_class": "module:Class", ...}`, further keys ignored -- plus the adapter code. The bundle
  folder is appended to sys.path (never prepended: an installed package of the same name is never
  shadowed), its module is imported when the registry is built and the class is checked against
  the generator contract. A bundle that cannot be used is skipped with one warning naming its
  folder and the problem; serving the architecture of such a bundle fails at start-up with that
  problem. A bundle overrides a built-in entry of the same name; between bundles, the first folder
  (directories in EXTRA_MODELS_DIR order, bundles sorted by name) wins.

The entry layout follows tenstorrent/vllm-tt-plugin (platform.py: register_tt_models and the
EXTRA_MODELS_DIR bundle scan); the built-in ttnn paths are the ones it registers for tt-metal.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("ttserve.worker.registry")

BACKENDS = ("torch", "ttnn")

# What the runner calls on a model class and its instances (tt-metal's generator contract).
# process_decode_output_host is optional: the plugin calls it only for decode output that is not
# already a host tensor (async_decode.py finalize_decode @e3fc849); DeepSeek V3's class has none.
CONTRACT_METHODS = ("initialize_vllm_model", "allocate_kv_cache", "prefill_forward", "decode_forward",
                    "read_decode_output")

METADATA_FILE = "vllm_metadata.json"

_TT_TRANSFORMERS = "models.tt_transformers.tt.generator_vllm"
_GALAXY = "models.demos.llama3_70b_galaxy.tt.generator_vllm"
_GEMMA4 = "models.demos.gemma4.tt.generator_vllm"
_QWEN36 = "models.demos.blackhole.qwen36.tt.qwen36_vllm"

# The built-in ttnn table is every registration of register_tt_models in tenstorrent/vllm-tt-plugin
# @ e3fc849, src/vllm_tt_plugin/platform.py (line of each given below), with the plugin's module:Class.
# The tt-metal file each class lives in was read in tenstorrent/tt-metal as stored in the search
# index (commit, or index id where the stored text names no commit); "(earlier pass)": checked when
# the entry was added (tt_models.py names those versions), not re-read for this table:
#   TTLlamaForCausalLM            :631-649  selector TT_LLAMA_TEXT_VER (tt_transformers generator_vllm.py
#                                           id 54494048887; Galaxy and llama2_70b: earlier pass)
#   TTMllamaForConditionalGeneration :652-656  tt_transformers generator_vllm.py (index id 54494048887)
#   TTQwen2ForCausalLM            :659-660  tt_transformers generator_vllm.py (id 54494048887)
#   TTQwen3ForCausalLM            :663-676  selector TT_QWEN3_TEXT_VER (as TTLlamaForCausalLM)
#   TTQwen3_5ForConditionalGeneration :678-692  selector TT_QWEN35_TEXT_VER, only "qwen36_blackhole":
#                                           models/demos/blackhole/qwen36/tt/qwen36_vllm.py @ 01c8afed
#                                           (id 54492196086), tt/common.py @ 296021c4, tt/model_config.py
#                                           @ 009f48d4, tt/generator_interface.py @ 040a27c1
#   TTQwen2_5_VLForConditionalGeneration :695-699  models/demos/qwen25_vl/tt/generator_vllm.py (earlier pass)
#   TTQwen3VLForConditionalGeneration    :702-706  models/demos/qwen3_vl/tt/generator_vllm.py (earlier pass)
#   TTMistralForCausalLM          :709-713  tt_transformers generator_vllm.py (id 54494048887)
#   TTMistral3ForConditionalGeneration :716-720  tt_transformers generator_vllm.py (id 54494048887)
#   TTGemma3ForConditionalGeneration   :722-727  tt_transformers generator_vllm.py (id 54494048887):
#                                           HybridAttentionForCausalLM, _HYBRID_KV_CACHE_GROUPS_ENABLED False
#   TTGemma4ForCausalLM, TTGemma4ForConditionalGeneration, TTGemma4UnifiedForConditionalGeneration
#                                 :729-764  (the plugin also registers the names without "TT"; here
#                                           tt_name adds it) models/demos/gemma4/tt/generator_vllm.py
#                                           @ 00b97ff1 (id 68508136212), tt/common.py @ 009a4e26
#   TTDeepseekV3ForCausalLM       :766-771  models/demos/deepseek_v3/tt/generator_vllm.py @ 01656bf7 (earlier pass)
#   TTGptOssForCausalLM           :773-778  tt_transformers generator_vllm.py (id 54494048887):
#                                           HybridAttentionForCausalLM, _HYBRID_KV_CACHE_GROUPS_ENABLED False
#   test models (register_tt_test_models) :785-808

# Selector variable -> {value: module:Class}; the first value is the default.
SELECTORS: dict[str, tuple[str, dict[str, str]]] = {
    "TT_LLAMA_TEXT_VER": ("TTLlamaForCausalLM", {
        "tt_transformers": f"{_TT_TRANSFORMERS}:LlamaForCausalLM",
        "llama3_70b_galaxy": f"{_GALAXY}:LlamaForCausalLM",
        "llama2_70b": "models.demos.t3000.llama2_70b.tt.generator_vllm:TtLlamaForCausalLM",
    }),
    "TT_QWEN3_TEXT_VER": ("TTQwen3ForCausalLM", {
        "tt_transformers": f"{_TT_TRANSFORMERS}:QwenForCausalLM",
        "qwen3_32b_galaxy": f"{_GALAXY}:QwenForCausalLM",
    }),
    # Qwen 3.5 / 3.6 (Gated DeltaNet + paged full attention), the plugin's only choice.
    "TT_QWEN35_TEXT_VER": ("TTQwen3_5ForConditionalGeneration", {
        "qwen36_blackhole": f"{_QWEN36}:Qwen36ForCausalLM",
    }),
}

# Classes of tt-metal that the selectors do not switch: text generation, and the vision models
# the plugin registers (platform.py), which take images as prefill_forward's pixel_values and
# image_grid_thw (worker/runner.py gathers them as the plugin's _gather_multi_modal_inputs).
_TTNN_FIXED = {
    "TTMllamaForConditionalGeneration": "models.tt_transformers.tt.generator_vllm:MllamaForConditionalGeneration",
    "TTQwen2_5_VLForConditionalGeneration":
        "models.demos.qwen25_vl.tt.generator_vllm:Qwen2_5_VLForConditionalGeneration",
    "TTQwen3VLForConditionalGeneration":
        "models.demos.qwen3_vl.tt.generator_vllm:Qwen3VLForConditionalGeneration",
    "TTMistral3ForConditionalGeneration": f"{_TT_TRANSFORMERS}:Mistral3ForConditionalGeneration",
    "TTGemma3ForConditionalGeneration": f"{_TT_TRANSFORMERS}:Gemma3ForConditionalGeneration",
    # Gemma 4: one text-only class for the text, multimodal and "unified" (12B) checkpoints.
    "TTGemma4ForCausalLM": f"{_GEMMA4}:Gemma4ForCausalLM",
    "TTGemma4ForConditionalGeneration": f"{_GEMMA4}:Gemma4ForCausalLM",
    "TTGemma4UnifiedForConditionalGeneration": f"{_GEMMA4}:Gemma4ForCausalLM",
    "TTQwen2ForCausalLM": f"{_TT_TRANSFORMERS}:QwenForCausalLM",
    "TTMistralForCausalLM": f"{_TT_TRANSFORMERS}:MistralForCausalLM",
    "TTGptOssForCausalLM": f"{_TT_TRANSFORMERS}:GptOssForCausalLM",
    "TTDeepseekV3ForCausalLM": "models.demos.deepseek_v3.tt.generator_vllm:DeepseekV3ForCausalLM",
}


# tt-metal's dummy models for the plugin's own tests, registered with tt.register_test_models
# (vllm-tt-plugin platform.py).
_TTNN_TEST_MODELS = {
    "TTDummyT3000MultiProcessModel":
        "models.vllm_test_utils.t3000_multiproc_test.test_model:DummyT3000MultiProcessModel",
    "TTDummyNoOpModel": "models.vllm_test_utils.no_op_test.test_model:DummyNoOpModel",
    "TTDummyDualGlxModel": "models.vllm_test_utils.dual_glx_ccl_test.test_model:DummyDualGlxModel",
}


class RegistryError(ValueError):
    """The registry cannot be built as configured, or the selected model class cannot be used."""


class UnknownArchitecture(RegistryError):
    """No registered model class serves this checkpoint."""


class ModelLoadError(RegistryError):
    """The entry for the checkpoint's architecture exists but its class cannot be imported or
    does not implement the generator contract."""


def mixture_of_experts(hf_config: Mapping) -> bool:
    """A checkpoint's config.json declares more than one expert (the keys Mixtral, Qwen-MoE and
    DeepSeek use): data parallelism over independent groups is refused for it."""
    return any(int(hf_config.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))


def tt_name(arch: str) -> str:
    """The registry name of a Hugging Face architecture: TT-prefixed, as the plugin names them."""
    return arch if arch.startswith("TT") else "TT" + arch


@dataclass(frozen=True)
class Entry:
    """One registered architecture. `target` is a class, or a lazy "module:Class" string."""

    name: str
    target: type | str
    source: str  # "torch" / "ttnn" for built-ins, else the bundle folder
    variant: str | None = None  # the selector value that chose a built-in ttnn class

    @property
    def is_bundle(self) -> bool:
        return self.source not in BACKENDS

    @property
    def target_name(self) -> str:
        if isinstance(self.target, str):
            return self.target
        return f"{self.target.__module__}:{self.target.__qualname__}"

    def load(self) -> type:
        """The class, imported on first use; ModelLoadError says why it cannot be had."""
        if not isinstance(self.target, str):
            return self.target
        cls, problem = load_target(self.target, hint=self.source == "ttnn")
        if problem:
            where = f"bundle {self.source}" if self.is_bundle else f"built-in {self.source} entry"
            raise ModelLoadError(f"{self.name} ({where}): {problem}")
        return cls


def load_target(target: str, hint: bool = False) -> tuple[type | None, str | None]:
    """The class named by "module:Class" if it imports and meets the contract, else the problem."""
    try:
        cls = import_target(target)
    except Exception as e:  # noqa: BLE001 - any failure of foreign import-time code
        return None, import_problem(target, e, hint)
    problem = contract_problem(cls)
    return (None, f"{target} {problem}") if problem else (cls, None)


def import_problem(target: str, error: BaseException, tt_metal: bool = False) -> str:
    """One line on why `target` did not import. A missing vLLM is named as such: tt-metal's
    generator_vllm modules import it at their top, and the fix is not PYTHONPATH."""
    module = target.partition(":")[0]
    missing = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
    if missing and missing.split(".")[0] == "vllm":
        from ..backends.ttnn.tt_models import VLLM_FIX
        return (f"{module} imports vLLM at its top and vLLM is not importable here "
                f"({sys.executable}): {VLLM_FIX}")
    tip = (" (is tt-metal installed, with its root on PYTHONPATH?)"
           if tt_metal and isinstance(error, ModuleNotFoundError) else "")
    return f"cannot import {target}: {type(error).__name__}: {error}{tip}"


def import_target(target: str) -> type:
    module_name, _, attr = target.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def contract_problem(cls: object) -> str | None:
    """Why `cls` cannot be driven by the runner, or None."""
    if not isinstance(cls, type):
        return f"is a {type(cls).__name__}, not a class"
    missing = [m for m in CONTRACT_METHODS if not callable(getattr(cls, m, None))]
    if missing == ["allocate_kv_cache"] and callable(getattr(cls, "allocate_kv_cache_per_layer", None)):
        from ..backends.ttnn.tt_models import PER_LAYER_ONLY
        return PER_LAYER_ONLY
    if missing:
        return f"does not implement the generator contract: no {', '.join(missing)}"
    from ..backends.ttnn.tt_models import hybrid_kv_cache_problem
    problem = hybrid_kv_cache_problem(cls)
    if problem:
        return problem
    caps = getattr(cls, "model_capabilities", {})
    if not isinstance(caps, Mapping):
        return f"has model_capabilities of type {type(caps).__name__}, not a dict"
    return None


def _valid_target(target: str) -> bool:
    module_name, sep, attr = target.partition(":")
    return bool(sep) and ":" not in attr and all(
        p.isidentifier() for p in module_name.split(".") + attr.split("."))


class Registry:
    """Architectures a worker of one backend can serve."""

    def __init__(self, backend: str, entries: Mapping[str, Entry],
                 skipped: Mapping[str, str] | None = None,
                 broken: Mapping[str, tuple[str, str]] | None = None) -> None:
        self.backend = backend
        self.entries = dict(entries)
        self.skipped = dict(skipped or {})  # bundle folder -> what is wrong with it
        self._broken = dict(broken or {})  # TT name -> (folder, problem) of an unusable bundle

    def names(self) -> list[str]:
        return sorted(self.entries)

    def __contains__(self, arch: str) -> bool:
        return tt_name(arch) in self.entries

    def entry(self, arch: str) -> Entry:
        return self.entries[tt_name(arch)]

    def resolve(self, architectures: list[str]) -> tuple[str, type]:
        """The first declared architecture with an entry (as declared) and its class.

        Raises UnknownArchitecture (listing the registered names) when none has an entry, and
        ModelLoadError when the chosen entry cannot be imported or misses the contract.
        """
        arch, entry = self.select(architectures)
        return arch, entry.load()

    def select(self, architectures: list[str]) -> tuple[str, Entry]:
        """The first declared architecture with an entry and that entry, imported nothing yet."""
        for arch in architectures:
            name = tt_name(arch)
            if name in self._broken:
                folder, problem = self._broken[name]
                raise ModelLoadError(f"{arch} is provided by bundle {folder}, which cannot be "
                                     f"used: {problem}")
            if name in self.entries:
                return arch, self.entries[name]
        declared = ", ".join(architectures) or "(none declared in config.json)"
        skipped = (f" ({len(self.skipped)} bundle(s) under EXTRA_MODELS_DIR were skipped, see the "
                   "warnings above)" if self.skipped else "")
        raise UnknownArchitecture(
            f"no model is registered for architecture {declared} on the {self.backend} backend; "
            f"registered: {', '.join(self.names()) or '(none)'}{skipped}")


def builtins_enabled(env: Mapping[str, str]) -> bool:
    value = env.get("TT_VLLM_BUILTIN_MODELS")
    return value is None or value.strip().lower() not in ("0", "false", "no", "off")


def builtin_entries(backend: str, env: Mapping[str, str], test_models: bool = False) -> dict[str, Entry]:
    if backend == "torch":
        from ..backends.torch.models import REFERENCE_ARCHITECTURES
        return {tt_name(arch): Entry(tt_name(arch), cls, "torch")
                for arch, cls in REFERENCE_ARCHITECTURES.items()}
    fixed = {**_TTNN_FIXED, **(_TTNN_TEST_MODELS if test_models else {})}
    entries = {name: Entry(name, target, "ttnn") for name, target in fixed.items()}
    for var, (name, choices) in SELECTORS.items():
        value = env.get(var) or next(iter(choices))
        if value not in choices:
            raise RegistryError(f"{var}={value!r} is not a known {name} implementation; "
                                f"choose one of {', '.join(choices)}")
        entries[name] = Entry(name, choices[value], "ttnn", variant=value)
    return dict(sorted(entries.items()))


def _bundle_dirs(env: Mapping[str, str]) -> list[Path]:
    value = env.get("EXTRA_MODELS_DIR") or ""
    dirs = []
    for part in value.split(os.pathsep):
        if not part.strip():
            continue
        path = Path(part).expanduser()
        if not path.is_dir():
            log.warning("EXTRA_MODELS_DIR entry %s is not a directory; ignoring it", path)
            continue
        dirs.append(path)
    return dirs


def _read_metadata(folder: Path) -> tuple[str, str]:
    """(arch, main_class) of a bundle; RegistryError says what is wrong."""
    meta = folder / METADATA_FILE
    if not meta.is_file():
        raise RegistryError(f"no {METADATA_FILE}")
    try:
        data = json.loads(meta.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise RegistryError(f"cannot read {METADATA_FILE}: {e}") from e
    if not isinstance(data, dict):
        raise RegistryError(f"{METADATA_FILE} must hold a JSON object, not {type(data).__name__}")
    missing = [k for k in ("arch", "main_class") if not data.get(k)]
    if missing:
        raise RegistryError(f"{METADATA_FILE} lacks {' and '.join(repr(k) for k in missing)} "
                            '(expected {"arch": "<HFArch>", "main_class": "module:Class"})')
    arch, main_class = data["arch"], data["main_class"]
    if not isinstance(arch, str) or not arch.isidentifier():
        raise RegistryError(f"{METADATA_FILE}: 'arch' must be an architecture name, got {arch!r}")
    if not isinstance(main_class, str) or not _valid_target(main_class):
        raise RegistryError(f"{METADATA_FILE}: 'main_class' must be \"module:Class\", got {main_class!r}")
    return arch, main_class


def _shadowing_problem(folder: Path, main_class: str) -> str | None:
    """A bundle module that would resolve to another folder's module of the same name."""
    top = main_class.partition(":")[0].split(".")[0]
    own = [p for p in (folder / f"{top}.py", folder / top) if p.exists()]
    if not own:
        return None  # main_class names an installed module, which is allowed
    spec = importlib.util.find_spec(top) if top not in sys.modules else None
    origin = getattr(sys.modules.get(top), "__file__", None) if spec is None else spec.origin
    if origin is None:
        return None
    if Path(origin).resolve().is_relative_to(folder.resolve()):
        return None
    return (f"its module {top!r} is shadowed by {origin} (already imported or earlier on sys.path); "
            "give the bundle's module a unique name")


def _load_bundle(folder: Path, arch: str, main_class: str) -> Entry:
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
    problem = _shadowing_problem(folder, main_class)
    if problem is None:
        cls, problem = load_target(main_class)
    if problem:
        raise ModelLoadError(problem)
    return Entry(tt_name(arch), cls, str(folder))


def bundle_entries(env: Mapping[str, str]) -> tuple[dict[str, Entry], dict[str, str],
                                                     dict[str, tuple[str, str]]]:
    """Usable bundles by name, skipped folders with their problem, and unusable bundles by name."""
    entries: dict[str, Entry] = {}
    skipped: dict[str, str] = {}
    broken: dict[str, tuple[str, str]] = {}

    def skip(folder: Path, problem: str) -> None:
        skipped[str(folder)] = problem
        log.warning("EXTRA_MODELS_DIR: skipping bundle %s: %s", folder, problem)

    for base in _bundle_dirs(env):
        for folder in sorted(base.iterdir()):
            if not folder.is_dir() or folder.name.startswith((".", "__")):
                continue
            try:
                arch, main_class = _read_metadata(folder)
            except RegistryError as e:
                skip(folder, str(e))
                continue
            name = tt_name(arch)
            if name in entries:
                skip(folder, f"{name} is already provided by bundle {entries[name].source}")
                continue
            try:
                entries[name] = _load_bundle(folder, arch, main_class)
            except ModelLoadError as e:
                skip(folder, str(e))
                broken.setdefault(name, (str(folder), str(e)))
                continue
            broken.pop(name, None)
            log.info("registered %s -> %s (bundle %s)", name, main_class, folder)
    return entries, skipped, broken


def build_registry(backend: str, env: Mapping[str, str] = os.environ, test_models: bool = False) -> Registry:
    """The registry of `backend` ("torch" or "ttnn") under the environment `env`; `test_models`
    (tt.register_test_models) adds tt-metal's dummy test models to the ttnn built-ins."""
    if backend not in BACKENDS:
        raise RegistryError(f"no model registry for backend {backend!r}; backends: {', '.join(BACKENDS)}")
    entries = builtin_entries(backend, env, test_models) if builtins_enabled(env) else {}
    bundles, skipped, broken = bundle_entries(env)
    for name, entry in bundles.items():
        if name in entries:
            log.info("bundle %s overrides the built-in %s (%s)", entry.source, name,
                     entries[name].target_name)
    entries.update(bundles)
    return Registry(backend, entries, skipped, broken)
