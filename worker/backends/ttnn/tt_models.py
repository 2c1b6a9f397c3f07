"""What tt-metal's model classes need from the worker that hosts them, beyond the generator
contract's methods: the environment they read, how `--data-parallel-size` reaches them
(`tt_data_parallel`), the KV budget they state, and where their sampler stops.

These are the rules of the TT vLLM plugin and of tt-metal's model code, read from their source
(tenstorrent/vllm-tt-plugin @ e3fc849 platform.py, worker.py, input_batch.py; tt-metal
models/tt_transformers/tt/generator_vllm.py, model_config.py, models/common/model_capabilities.py,
models/demos/llama3_70b_galaxy/tt/generator_vllm.py, model_config.py, qwen_model_config.py,
models/demos/deepseek_v3/tt/generator_vllm.py).
Pure Python: nothing here imports ttnn, torch or tt-metal (a tt-metal module is at most located
and its source parsed), so `ttserve check` and the worker's start-up apply the same rules before
any device is touched.
"""
from __future__ import annotations

import ast
import importlib.machinery
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ...planning.mesh import MeshSpec

log = logging.getLogger(__name__)

# The plugin folds --data-parallel-size into in-process lanes for these generator versions
# (platform.py _GALAXY_GENERATOR_VERSIONS) and for GPT-OSS (_model_folds_dp_into_lanes); every
# other tt-metal class runs one process per data-parallel rank, each on its own submesh.
GALAXY_GENERATOR_VERSIONS = {"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy", "TT_QWEN3_TEXT_VER": "qwen3_32b_galaxy"}
_GPT_OSS = "GptOssForCausalLM"
_DEEPSEEK = "DeepseekV3ForCausalLM"

# ModelCapabilitiesMixin.FALLBACK_MAX_TOKENS_ALL_USERS: the plugin's budget for a class that
# states none (worker.py get_num_available_blocks_tt).
FALLBACK_KV_TOKENS = 131_072

# tt-metal's device sampler keeps at most 32 candidates: format_sampling_params turns top_k < 1
# or > 32 into 32 (models/common/sampling). Some adapters state it as `max_device_top_k`.
DEVICE_TOP_K = 32

# The variable each model family reads to find its checkpoint: tt_transformers' ModelArgs
# asserts HF_MODEL ("Please set HF_MODEL to a HuggingFace name ..."), DeepSeek V3's bridge raises
# without DEEPSEEK_V3_HF_MODEL. The Galaxy generators build TtQwenModelArgs, which reads HF_MODEL
# only ("Please set HF_MODEL to a HuggingFace name e.g. Qwen/Qwen3-32B", qwen_model_config.py),
# and TtModelArgs, which takes HF_MODEL or LLAMA_DIR but never both (model_config.py): HF_MODEL
# serves both (tt-metal issue 42139 moves the Galaxy demo to it). Keyed by the defining module.
_CHECKPOINT_VARIABLES = {
    "models.tt_transformers.": "HF_MODEL",
    # The vision demos build their ModelArgs on tt_transformers' (qwen25_vl/tt/model_config.py).
    "models.demos.qwen25_vl.": "HF_MODEL",
    "models.demos.qwen3_vl.": "HF_MODEL",
    "models.demos.llama3_70b_galaxy.": "HF_MODEL",
    "models.demos.deepseek_v3.": "DEEPSEEK_V3_HF_MODEL",
}

# Meta-style checkpoint folder of the older Llama demos. tt-metal's Galaxy TtModelArgs asserts
# `not (LLAMA_DIR and HF_MODEL)` ("Only one of LLAMA_DIR or HF_MODEL should be set"), so a
# LLAMA_DIR the worker inherited is dropped from the environment of a class that reads HF_MODEL.
_LEGACY_CHECKPOINT_VARIABLE = "LLAMA_DIR"

# How tt-metal's vision classes take images (each generator_vllm.py), as the plugin's model
# runner passes them: pixel_values and image_grid_thw per prefill user (model_runner.py
# `_gather_multi_modal_inputs`).
# - Qwen2.5-VL, Qwen3-VL: prefill_forward(..., pixel_values=, image_grid_thw=) returns (logits,
#   rope_deltas); decode_forward takes rope_deltas_all_users. Qwen3-VL reads the first user's
#   entry to decide whether the batch has images ("we currently do not support mixed inputs of
#   text-only users and text-image users"): its prefills run one user at a time.
# - Gemma3: prefill_forward(**kwargs) -> prefill_forward_text with pixel_values per user.
# - Mllama, Mistral3: prefill_forward(tokens, images, page_table, kv_cache, prompt_lens,
#   cross_page_table): PIL images and a cross-attention page table, the encoder-decoder path the
#   plugin's model runner refuses ("Encoder-decoder models aren't yet supported for TT").
ONE_PREFILL_USER_CLASSES = ("Qwen3VLForConditionalGeneration",)
# Classes whose generator holds one model and no submeshes (models/demos/qwen3_vl/tt/generator.py:
# `model` is `model[0]`, "change this when implementing data parallelism"); its prefill_forward
# ignores empty_slots and prefills batch index i as user i, so a second lane cannot be served.
SINGLE_LANE_CLASSES = ("Qwen3VLForConditionalGeneration",)
CROSS_ATTENTION_CLASSES = ("MllamaForConditionalGeneration", "Mistral3ForConditionalGeneration")

# What a tt-metal host installs for those modules: the vLLM build tt-metal's LLMs table pins,
# built by the plugin's docs/install-vllm-tt.sh (vLLM 0.25.1, VLLM_TARGET_DEVICE=empty,
# --no-deps). PyPI's vllm would bring a CUDA torch over tt-metal's own.
VLLM_FIX = ("install the vLLM build tt-metal pins into this Python (vllm-tt-plugin's "
            "docs/install-vllm-tt.sh builds vLLM 0.25.1 with VLLM_TARGET_DEVICE=empty; see README "
            "'Tenstorrent hosts'), or serve the model from an EXTRA_MODELS_DIR bundle that does not import vLLM")


@dataclass(frozen=True, slots=True)
class ModelFamily:
    """A selected tt-metal class as these rules see it: its name, the module that defines it and
    the selector value (TT_LLAMA_TEXT_VER, ...) that chose it, if any."""
    class_name: str
    module: str
    variant: str | None = None

    @classmethod
    def of(cls, target: str, variant: str | None = None) -> ModelFamily:
        """From a registry target, "module:Class"."""
        module, _, name = target.partition(":")
        return cls(name.rsplit(".", 1)[-1], module, variant)

    @property
    def is_galaxy_generator(self) -> bool:
        return self.variant in GALAXY_GENERATOR_VERSIONS.values()

    @property
    def is_deepseek(self) -> bool:
        return self.class_name == _DEEPSEEK

    @property
    def imports_vllm(self) -> bool | None:
        """Whether the defining module imports vLLM at its top (see `module_imports_vllm`)."""
        return module_imports_vllm(self.module)

    @property
    def checkpoint_variable(self) -> str | None:
        return next((var for prefix, var in _CHECKPOINT_VARIABLES.items() if self.module.startswith(prefix)), None)


def module_imports_vllm(module: str) -> bool | None:
    """Whether `module`'s source imports vLLM unconditionally at its top (tt_transformers'
    generator_vllm imports gemma3_mm, mistral3, MULTIMODAL_REGISTRY; the Galaxy one did
    `import vllm.envs` until tt-metal dropped it), read from the file the import would load,
    found without importing it or its packages. None when the source cannot be found or read:
    then nothing is assumed, and a failing import names a missing vLLM itself."""
    source = _module_source(module)
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] == "vllm" for name in names):
            return True
    return False


def _module_source(module: str) -> str | None:
    """The source of `module` as `import` would find it: an already-imported package's __path__,
    else the path finders over sys.path, one package level at a time (no __init__ runs)."""
    parts = module.split(".")
    search: list[str] | None = None
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        loaded = sys.modules.get(name, False)
        if loaded is None:       # blocked: importing it raises
            return None
        if loaded is not False and depth < len(parts):
            search = list(getattr(loaded, "__path__", None) or [])
            if not search:
                return None
            continue
        if loaded is not False:  # the module itself is loaded
            origin = getattr(getattr(loaded, "__spec__", None), "origin", None) or getattr(loaded, "__file__", None)
            return _read(origin)
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, search)
        except (ImportError, ValueError, OSError):
            return None
        if spec is None:
            return None
        if depth < len(parts):
            search = list(spec.submodule_search_locations or [])
            if not search:
                return None
        else:
            return _read(spec.origin)
    return None


def _read(origin: str | None) -> str | None:
    if not origin or not origin.endswith(".py"):
        return None
    try:
        return Path(origin).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def folds_dp_into_lanes(family: ModelFamily, env: Mapping[str, str]) -> bool:
    """Whether the class runs every lane in one process (the plugin's `_model_folds_dp_into_lanes`:
    a Galaxy generator version selected in the environment, or GPT-OSS)."""
    if any(env.get(var) == version for var, version in GALAXY_GENERATOR_VERSIONS.items()):
        return True
    return family.class_name == _GPT_OSS


def tt_data_parallel(family: ModelFamily, num_lanes: int, spec: MeshSpec) -> int:
    """The `tt_data_parallel` that `initialize_vllm_model` gets: the lane count (what the plugin
    passes), except DeepSeek V3, whose bridge accepts only the mesh's device count."""
    return spec.num_devices if family.is_deepseek else num_lanes


# tt_transformers ModelArgs: supported_batches = {1, 2, 4, 8, 16, 32} (each submesh's rows).
_TT_TRANSFORMERS_BATCHES = frozenset({1, 2, 4, 8, 16, 32})


def data_parallel_problem(family: ModelFamily, num_lanes: int, max_num_seqs: int, spec: MeshSpec) -> str | None:
    """Why `initialize_vllm_model` would refuse this lane count on this mesh, with what to do."""
    if family.class_name in SINGLE_LANE_CLASSES and num_lanes > 1:
        return (f"--data-parallel-size {num_lanes}: {family.class_name}'s generator holds one model and "
                "ignores empty_slots (models/demos/qwen3_vl/tt/generator.py), so every request would "
                "prefill into the first lane's KV cache: use --data-parallel-size 1")
    if family.is_galaxy_generator:
        problem = _galaxy_lanes_problem(family, num_lanes, spec)
        if problem:
            return problem
    if family.module.startswith("models.tt_transformers.") and max_num_seqs not in _TT_TRANSFORMERS_BATCHES:
        # model_config.py ModelArgs: "Batch size {max_batch_size} not supported" (per submesh).
        return (f"--max-num-seqs {max_num_seqs}: tt_transformers' ModelArgs supports batch sizes "
                f"{', '.join(map(str, sorted(_TT_TRANSFORMERS_BATCHES)))} per lane; choose one of them")
    if family.is_deepseek and (num_lanes * max_num_seqs) % spec.num_devices:
        return (f"--max-num-seqs {max_num_seqs}: DeepSeek V3 splits its {num_lanes * max_num_seqs} rows "
                f"over the mesh's {spec.num_devices} devices, so the rows must be a multiple of "
                f"{spec.num_devices}")
    return None


# The only mesh size tt-metal's Galaxy model args accept: TtModelArgs and TtQwenModelArgs raise
# "Unsupported number of devices: N. Only 32 devices (Galaxy) are supported." (model_config.py,
# qwen_model_config.py); a 16-device submesh fails earlier, on their device-name table.
GALAXY_DEVICES = 32


def _galaxy_lanes_problem(family: ModelFamily, num_lanes: int, spec: MeshSpec) -> str | None:
    """The Galaxy generator's initialize_vllm_text_transformer[_qwen] asserts that tt_data_parallel
    divides by dp_attention_factor = mesh_device.shape[1], divides it by that factor, cuts the
    mesh into that many submeshes (create_submeshes: "Unsupported device split") and builds model
    args per submesh, which take 32 devices only: so the mesh has 32 devices and the lane count is
    its column count (4 on a TG), one submesh, the whole mesh."""
    if spec.num_devices != GALAXY_DEVICES:
        return (f"MESH_DEVICE={spec.name} ({spec.rows}x{spec.cols}, {spec.num_devices} device(s)): the Galaxy "
                f"generator {family.variant} builds its model on {GALAXY_DEVICES} devices only (TtModelArgs: "
                f"\"Only 32 devices (Galaxy) are supported\"): use MESH_DEVICE=TG on a Galaxy")
    if num_lanes != spec.cols:
        return (f"--data-parallel-size {num_lanes}: the Galaxy generator {family.variant} divides the lane count "
                f"by the mesh's {spec.cols} columns (dp_attention_factor of MESH_DEVICE={spec.name}, "
                f"{spec.rows}x{spec.cols}) into submeshes, and its model takes only the whole "
                f"{GALAXY_DEVICES}-device mesh, so the lane count must be {spec.cols}: use "
                f"--data-parallel-size {spec.cols}")
    return None


def optimizations_problem(family: ModelFamily, options: Mapping[str, Any]) -> str | None:
    """The Galaxy and GPT-OSS generators assert `optimizations is None`; DeepSeek V3's takes the
    argument and ignores it (deepseek_v3/tt/generator_vllm.py @01656bf): refused too, since the
    setting would do nothing."""
    if "optimizations" in options and (family.is_galaxy_generator or family.is_deepseek
                                       or family.class_name == _GPT_OSS):
        why = "it ignores them" if family.is_deepseek else "it asserts optimizations is None"
        return (f"tt.optimizations = {options['optimizations']!r}: {family.module}:{family.class_name} "
                f"takes no custom optimizations ({why}); unset it")
    return None


@dataclass(frozen=True, slots=True)
class CheckpointEnvironment:
    """What the worker sets in its environment before the model is built, and why it cannot.
    A None value in `to_set` removes that variable."""
    to_set: dict[str, str | None]
    notes: list[str]
    problem: str | None = None


def checkpoint_environment(family: ModelFamily, model_path: Path, env: Mapping[str, str]) -> CheckpointEnvironment:
    """The checkpoint variable the class reads, set from --model; refused when the environment
    already names another checkpoint (the weights would not be the ones config.json describes).
    For a class that reads HF_MODEL an inherited LLAMA_DIR is removed: tt-metal's Galaxy
    TtModelArgs asserts that they are not both set, and HF_MODEL is the one that names --model."""
    notes = []
    if "TT_CACHE_PATH" in env:
        notes.append(f"TT_CACHE_PATH={env['TT_CACHE_PATH']} (weight cache; tt-metal appends the device name)")
    var = family.checkpoint_variable
    if var is None:
        return CheckpointEnvironment({}, notes)
    to_set: dict[str, str | None] = {}
    current = env.get(var)
    if not current:
        to_set[var] = str(model_path)
        notes.append(f"{var}={model_path} (set from --model)")
    elif _same_path(current, model_path):
        notes.append(f"{var}={current} (already set, names --model)")
    else:
        return CheckpointEnvironment({}, notes, (
            f"{var}={current} names another checkpoint than --model {model_path}; {family.class_name} "
            f"loads its weights from {var}: unset it (the worker sets it from --model) or pass the same folder"))
    legacy = _LEGACY_CHECKPOINT_VARIABLE
    if var == "HF_MODEL" and env.get(legacy):
        to_set[legacy] = None
        notes.append(f"{legacy}={env[legacy]} unset for the model (it reads HF_MODEL; tt-metal's Galaxy "
                     f"TtModelArgs refuses {legacy} and HF_MODEL together)")
    return CheckpointEnvironment(to_set, notes)


def _same_path(value: str, model_path: Path) -> bool:
    try:
        return Path(value).expanduser().resolve() == model_path.resolve()
    except (OSError, RuntimeError):
        return False


def apply_environment(to_set: Mapping[str, str | None]) -> None:
    """Sets the checkpoint variables in this process, where tt-metal's model code reads them;
    a None value removes the variable (an inherited LLAMA_DIR, see `checkpoint_environment`)."""
    for var, value in to_set.items():
        if value is not None:
            os.environ[var] = value
        elif var in os.environ:
            log.info("%s=%s removed from the environment the model reads: it reads HF_MODEL, and tt-metal's "
                     "Galaxy TtModelArgs refuses both set", var, os.environ.pop(var))


@dataclass(frozen=True, slots=True)
class KvBudget:
    tokens_per_lane: int
    source: str   # where the number comes from, for the plan and the start-up log


def kv_budget(model_cls: type, *, model_name: str, num_devices: int, tt_data_parallel: int, max_model_len: int,
              max_num_seqs: int, block_size: int) -> KvBudget:
    """KV tokens per lane as the plugin sizes them (worker.py get_num_available_blocks_tt): the
    class's `get_max_tokens_all_users`, or 131072 for a class without one, plus one block per
    row of headroom. Any other exception of the class's method is its refusal and propagates."""
    headroom = block_size * max_num_seqs
    try:
        stated = model_cls.get_max_tokens_all_users(
            model_name=model_name, num_devices=num_devices, tt_data_parallel=tt_data_parallel,
            max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    except AttributeError:
        return KvBudget(FALLBACK_KV_TOKENS + headroom,
                        f"{FALLBACK_KV_TOKENS} (the plugin's fallback: {model_cls.__name__} states no "
                        f"get_max_tokens_all_users) + {block_size}x{max_num_seqs} headroom")
    return KvBudget(int(stated) + headroom, f"{int(stated)} ({model_cls.__name__}.get_max_tokens_all_users for "
                                            f"{num_devices} device(s), tt_data_parallel {tt_data_parallel}) + "
                                            f"{block_size}x{max_num_seqs} headroom")


def device_top_k(capabilities: Mapping[str, Any]) -> int:
    """The largest top_k the model's device sampler honours exactly."""
    return int(capabilities.get("max_device_top_k") or DEVICE_TOP_K)


def kv_cache_dtype(hf_config: Mapping[str, Any]) -> str:
    """The KV cache's dtype: the checkpoint's 16-bit dtype, else bfloat16 (the plugin passes the
    model config's dtype, which vLLM resolves from the checkpoint and never leaves at float32
    on an accelerator)."""
    declared = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return declared if declared in ("bfloat16", "float16") else "bfloat16"


def image_input_problem(class_name: str) -> str | None:
    """A vision class whose prefill takes images in a form ttserve does not send."""
    if class_name in CROSS_ATTENTION_CLASSES:
        return (f"{class_name} takes PIL images and a cross-attention page table (tt-metal's "
                "encoder-decoder prefill_forward), which ttserve does not serve, as the TT plugin does not: "
                "serve a model that takes pixel_values (Qwen2.5-VL, Qwen3-VL, Gemma 3)")
    return None


def one_prefill_user(class_name: str) -> bool:
    """The class cannot prefill text-only and image users in one call."""
    return class_name in ONE_PREFILL_USER_CLASSES


def capability_problem(class_name: str, capabilities: Mapping[str, Any]) -> str | None:
    """A declared capability ttserve's step protocol cannot serve (model_capabilities.py keys)."""
    per_step = capabilities.get("output_tokens_per_step", 1)
    if per_step != 1:
        return (f"{class_name} declares output_tokens_per_step = {per_step!r}; ttserve's decode steps take one "
                "token per row: serve a generator that emits one token per step")
    return None
