"""What tt-metal's model classes need from the worker that hosts them, beyond the generator
contract's methods: the environment they read, how `--data-parallel-size` reaches them
(`tt_data_parallel`), the KV budget they state, and where their sampler stops.

These are the rules of the TT vLLM plugin and of tt-metal's model code, read from their source
(tenstorrent/vllm-tt-plugin @ e3fc849 platform.py, worker.py, input_batch.py; tt-metal
models/tt_transformers/tt/generator_vllm.py, model_config.py, models/common/model_capabilities.py,
models/demos/llama3_70b_galaxy/tt/generator_vllm.py, model_config.py, qwen_model_config.py,
models/demos/deepseek_v3/tt/generator_vllm.py; Gemma 4: models/demos/gemma4/tt/generator_vllm.py
@ 00b97ff1 (index id 68508136212) and tt/common.py @ 009a4e26; Qwen 3.5/3.6:
models/demos/blackhole/qwen36/tt/qwen36_vllm.py @ 01c8afed (index id 54492196086), tt/common.py
@ 296021c4, tt/model_config.py @ 009f48d4, tt/generator_interface.py @ 040a27c1; the hybrid-attention
base of Gemma 3, Gemma 4 and GPT-OSS: tt_transformers generator_vllm.py, index id 54494048887).
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

from ...planning.mesh import WORMHOLE, MeshSpec

log = logging.getLogger(__name__)

# The plugin folds --data-parallel-size into in-process lanes for these generator versions
# (platform.py _GALAXY_GENERATOR_VERSIONS) and for GPT-OSS (_model_folds_dp_into_lanes); every
# other tt-metal class runs one process per data-parallel rank, each on its own submesh.
GALAXY_GENERATOR_VERSIONS = {"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy", "TT_QWEN3_TEXT_VER": "qwen3_32b_galaxy"}
_GPT_OSS = "GptOssForCausalLM"
_DEEPSEEK = "DeepseekV3ForCausalLM"
_DEEPSEEK_CACHE = "DEEPSEEK_V3_CACHE"
_GEMMA4_MODULE = "models.demos.gemma4."
_QWEN36_MODULE = "models.demos.blackhole.qwen36."

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
    # Qwen 3.5/3.6: create_tt_model writes its weights folder to HF_MODEL, which Qwen36ModelArgs (a
    # tt_transformers ModelArgs) reads (tt/common.py, tt/model_config.py).
    _QWEN36_MODULE: "HF_MODEL",
    # Gemma 4 reads none: initialize_vllm_model passes hf_config._name_or_path (--model) to
    # create_tt_model, which falls back to HF_MODEL / GEMMA4_MODEL_PATH only when it is empty.
}

# Variables a class reads before its checkpoint variable, which would win over --model:
# Qwen36ForCausalLM.initialize_vllm_model takes MODEL_WEIGHTS_DIR, then HF_MODEL, then
# hf_config._name_or_path, and makes the winner HF_MODEL.
_OVERRIDING_CHECKPOINT_VARIABLES = {
    _QWEN36_MODULE: ("MODEL_WEIGHTS_DIR",),
}

# tt-metal's hybrid-attention bridges (HybridAttentionForCausalLM: Gemma 3, Gemma 4, GPT-OSS) can run
# vLLM's hybrid KV cache groups: one page table per layer (`page_tables_per_layer`, built by the
# plugin from `get_kv_cache_spec`'s groups) and per-group KV buffers (`allocate_kv_cache_per_layer`).
# `_HYBRID_KV_CACHE_GROUPS_ENABLED` turns it on. It is off in the base class and Gemma 3 / GPT-OSS
# keep it off (their prefill/decode then ignore page_tables_per_layer and use the one page_table);
# Gemma 4 sets it from an environment switch read when its module is imported. ttserve sends one
# page table for every layer, so a class with the groups on is refused, as is the switch.
HYBRID_KV_SWITCHES = {
    _GEMMA4_MODULE: "GEMMA4_HYBRID_KV_CACHE_GROUPS",  # `os.environ.get(..., "0") != "0"` turns it on
}
PER_LAYER_ONLY = ("allocates its KV cache only per layer (allocate_kv_cache_per_layer, no allocate_kv_cache): "
                  "it needs vLLM's hybrid KV cache groups, one page table per group (page_tables_per_layer), "
                  "and ttserve serves every layer from one page table; serve a class with allocate_kv_cache")

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
# - Gemma3: prefill_forward(**kwargs) -> prefill_forward_text with pixel_values (and
#   image_grid_thw) per user.
# - Mllama: prefill_forward(tokens, images, page_table, kv_cache, prompt_lens, cross_page_table):
#   PIL images and a cross-attention page table, the encoder-decoder path the plugin's model
#   runner refuses ("Encoder-decoder models aren't yet supported for TT").
# - Mistral3: older tt-metal (generator_vllm.py @ 0015d62b) has Mllama's cross-attention
#   signature; the version with HybridAttentionForCausalLM (index id 54494048887) is
#   decoder-only, prefill_forward(*args, **kwargs) reading kwargs["tokens"], kwargs["prompt_lens"]
#   and its images from kwargs["images"] (objects carrying pixel_values and image_sizes). Neither
#   reads pixel_values / image_grid_thw, what ttserve and the plugin send: its images would be
#   dropped, the prompt's image tokens prefilled as text.
ONE_PREFILL_USER_CLASSES = ("Qwen3VLForConditionalGeneration",)
# Classes whose generator holds one model and no submeshes, so a second lane cannot be served:
# Qwen3-VL (models/demos/qwen3_vl/tt/generator.py: `model` is `model[0]`, "change this when
# implementing data parallelism"; its prefill_forward ignores empty_slots and prefills batch index i
# as user i) and Qwen 3.6 (one model on the whole mesh, tt_data_parallel never read).
SINGLE_LANE_CLASSES = ("Qwen3VLForConditionalGeneration", "Qwen36ForCausalLM")
_SINGLE_LANE_WHY = {
    "Qwen3VLForConditionalGeneration": "its generator holds one model and ignores empty_slots "
                                       "(models/demos/qwen3_vl/tt/generator.py), so every request would "
                                       "prefill into the first lane's KV cache",
    # qwen36_vllm.py: create_tt_model(mesh_device, max_batch_size=max_batch_size, ...) on the whole
    # mesh, `cls([model], [args], mesh_device)`; tt_data_parallel is accepted and never read.
    "Qwen36ForCausalLM": "it builds one model on the whole mesh and ignores tt_data_parallel "
                         "(models/demos/blackhole/qwen36/tt/qwen36_vllm.py)",
}
# Vision classes whose prefill takes its images in a form ttserve does not send, and why.
_TAKES_OTHER_IMAGES = {
    "MllamaForConditionalGeneration": "takes PIL images and a cross-attention page table (tt-metal's "
                                      "encoder-decoder prefill_forward), which ttserve does not serve, as the "
                                      "TT plugin does not",
    "Mistral3ForConditionalGeneration": "reads its images from prefill_forward's `images` (current tt-metal: "
                                        "objects carrying pixel_values and image_sizes; older versions: PIL "
                                        "images with a cross-attention page table), never the pixel_values "
                                        "and image_grid_thw that ttserve, like the TT plugin, sends, so every "
                                        "image would be dropped",
}

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


# How deep module_imports_vllm follows tt-metal's own imports: Gemma 4's generator_vllm imports
# HybridAttentionForCausalLM from tt_transformers' generator_vllm, which imports vLLM (one level).
_VLLM_IMPORT_DEPTH = 3


def module_imports_vllm(module: str) -> bool | None:
    """Whether `module`'s source imports vLLM unconditionally at its top (tt_transformers'
    generator_vllm imports gemma3_mm, mistral3, MULTIMODAL_REGISTRY; the Galaxy one did
    `import vllm.envs` until tt-metal dropped it; Qwen 3.6's qwen36_vllm imports qwen3_5 and
    MULTIMODAL_REGISTRY), or imports at its top a module of tt-metal's `models` tree that does
    (Gemma 4's generator_vllm imports tt_transformers' generator_vllm), read from the files the
    imports would load, found without importing them or their packages. None when `module`'s own
    source cannot be found or read: then nothing is assumed, and a failing import names a missing
    vLLM itself."""
    return _imports_vllm(module, _VLLM_IMPORT_DEPTH, set())


def _imports_vllm(module: str, depth: int, seen: set[str]) -> bool | None:
    seen.add(module)
    source = _module_source(module)
    if source is None:
        return None
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    tt_metal: list[str] = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if any(name.split(".")[0] == "vllm" for name in names):
            return True
        tt_metal += [name for name in names if name.startswith("models.") and name not in seen]
    if depth > 0:
        for name in dict.fromkeys(tt_metal):
            if name not in seen and _imports_vllm(name, depth - 1, seen):
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
    """Why `initialize_vllm_model` would refuse this lane count on this mesh (or the class would
    serve it wrongly), with what to do."""
    if family.class_name in SINGLE_LANE_CLASSES and num_lanes > 1:
        why = _SINGLE_LANE_WHY.get(family.class_name, "its generator holds one model")
        return (f"--data-parallel-size {num_lanes}: {family.class_name} serves one lane: {why}: "
                "use --data-parallel-size 1")
    if family.is_galaxy_generator:
        problem = _galaxy_lanes_problem(family, num_lanes, spec)
        if problem:
            return problem
    if family.module.startswith(_QWEN36_MODULE) and spec.num_devices == 1 and max_num_seqs > 1:
        # qwen36_vllm.py prefill_forward: on one device it prefills prompt_lens[0] only
        # (generator_interface.prefill_dispatch), into its single-sequence DeltaNet state; the
        # per-slot (empty_slots) batched prefill exists only for num_devices > 1.
        return (f"--max-num-seqs {max_num_seqs}: {family.class_name} on one device (MESH_DEVICE={spec.name}) "
                "prefills one sequence into one DeltaNet state (its batched, per-slot path needs a multi-device "
                "mesh): use --max-num-seqs 1, or a tensor-parallel mesh such as P150x4")
    uses_model_args = family.module.startswith(("models.tt_transformers.", _QWEN36_MODULE))
    if uses_model_args and max_num_seqs not in _TT_TRANSFORMERS_BATCHES:
        # model_config.py ModelArgs: "Batch size {max_batch_size} not supported" (per submesh);
        # Qwen36ModelArgs is a ModelArgs, built with the whole max_batch_size.
        which = "tt_transformers' ModelArgs" if family.module.startswith("models.tt_transformers.") else \
            f"{family.class_name}'s Qwen36ModelArgs (a tt_transformers ModelArgs)"
        return (f"--max-num-seqs {max_num_seqs}: {which} supports batch sizes "
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


# tt_transformers' LlamaForCausalLM.initialize_vllm_model (generator_vllm.py, index id 54494048887;
# the same at 0015d62b) raises ValueError before its model args or weights load when
# hf_config._name_or_path contains "3.1-8B" or "3.2-11B", mesh_device.get_num_devices() == 1 and
# is_wormhole_b0(), for a max_seq_len above 32768 ("TT-LLama8B and TT-Llama11B do not support
# max_model_len greater than 32768 on N150"). The whole mesh counts, not a data-parallel share.
# ttserve passes --model as _name_or_path (backend.hf_config_for), so the path is what it reads.
_N150_LLAMA_NAMES = ("3.1-8B", "3.2-11B")
N150_LLAMA_MAX_MODEL_LEN = 32_768


def max_model_len_problem(family: ModelFamily, model_path: Path | str, max_model_len: int,
                          spec: MeshSpec) -> str | None:
    """Why the class's initialize_vllm_model would refuse `max_model_len` on this mesh, with what
    to do."""
    name = str(model_path)
    if (family.class_name != "LlamaForCausalLM" or not family.module.startswith("models.tt_transformers.")
            or not any(n in name for n in _N150_LLAMA_NAMES) or spec.num_devices != 1 or spec.arch != WORMHOLE
            or max_model_len <= N150_LLAMA_MAX_MODEL_LEN):
        return None
    return (f"max_model_len {max_model_len}: {family.module}:{family.class_name} refuses Llama 3.1 8B and 3.2 11B "
            f"above {N150_LLAMA_MAX_MODEL_LEN} tokens on one Wormhole device (MESH_DEVICE={spec.name}; tt-metal: "
            f"\"do not support max_model_len greater than {N150_LLAMA_MAX_MODEL_LEN} on N150\"): pass "
            f"--max-model-len {N150_LLAMA_MAX_MODEL_LEN} (or less) to the control plane, or serve on a bigger mesh "
            "such as N300")


def optimizations_problem(family: ModelFamily, options: Mapping[str, Any]) -> str | None:
    """The Galaxy and GPT-OSS generators assert `optimizations is None`; DeepSeek V3's takes the
    argument and ignores it (deepseek_v3/tt/generator_vllm.py @01656bf), as does Qwen 3.6's
    (qwen36_vllm.py): refused too, since the setting would do nothing. Gemma 4 takes None,
    "performance" or "accuracy" (ValueError otherwise), the only values tt.optimizations allows."""
    if "optimizations" not in options:
        return None
    value = options["optimizations"]
    ignores = family.is_deepseek or family.module.startswith(_QWEN36_MODULE)
    if family.is_galaxy_generator or ignores or family.class_name == _GPT_OSS:
        why = "it ignores them" if ignores else "it asserts optimizations is None"
        return (f"tt.optimizations = {value!r}: {family.module}:{family.class_name} "
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
    TtModelArgs asserts that they are not both set, and HF_MODEL is the one that names --model.

    Also refused here, before any weight loads, is an environment or checkpoint that asks the
    class for a KV cache ttserve does not build (`kv_cache_problem`): hybrid KV cache groups
    switched on (GEMMA4_HYBRID_KV_CACHE_GROUPS), or layers whose KV caches differ in shape."""
    notes = []
    if "TT_CACHE_PATH" in env:
        notes.append(f"TT_CACHE_PATH={env['TT_CACHE_PATH']} (weight cache; tt-metal appends the device name)")
    problem = kv_cache_problem(family, model_path, env)
    if problem:
        return CheckpointEnvironment({}, notes, problem)
    for var in next((names for prefix, names in _OVERRIDING_CHECKPOINT_VARIABLES.items()
                     if family.module.startswith(prefix)), ()):
        current = env.get(var)
        if current and not _same_path(current, model_path):
            return CheckpointEnvironment({}, notes, (
                f"{var}={current} names another checkpoint than --model {model_path}; {family.class_name} "
                f"loads its weights from {var} before any other variable: unset it or pass the same folder"))
        if current:
            notes.append(f"{var}={current} (already set, names --model)")
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
    if family.is_deepseek and not env.get(_DEEPSEEK_CACHE):
        # DeepseekGenerator._prepare_weight_configs converts the weights into DEEPSEEK_V3_CACHE,
        # else into ./generated/deepseek_v3 of whatever directory the worker runs in (/ under
        # systemd): named here, beside tt-metal's own weight cache when TT_CACHE_PATH is set.
        cache = Path(env.get("TT_CACHE_PATH") or Path.home() / ".cache" / "ttserve") / "deepseek_v3" / model_path.name
        to_set[_DEEPSEEK_CACHE] = str(cache)
        notes.append(f"{_DEEPSEEK_CACHE}={cache} (converted weights; set it to choose another folder)")
    legacy = _LEGACY_CHECKPOINT_VARIABLE
    if var == "HF_MODEL" and env.get(legacy):
        to_set[legacy] = None
        notes.append(f"{legacy}={env[legacy]} unset for the model (it reads HF_MODEL; tt-metal's Galaxy "
                     f"TtModelArgs refuses {legacy} and HF_MODEL together)")
    return CheckpointEnvironment(to_set, notes)


def hybrid_kv_cache_problem(model_cls: type) -> str | None:
    """A class that runs vLLM's hybrid KV cache groups (`_HYBRID_KV_CACHE_GROUPS_ENABLED`, read
    from its environment switch when tt-metal imported it): it expects one page table per group."""
    if getattr(model_cls, "_HYBRID_KV_CACHE_GROUPS_ENABLED", False) is not True:
        return None
    module = getattr(model_cls, "__module__", "")
    switch = next((var for prefix, var in HYBRID_KV_SWITCHES.items() if module.startswith(prefix)), None)
    fix = f"unset {switch} (or set it to 0)" if switch else "serve it with hybrid KV cache groups off"
    return (f"has hybrid KV cache groups on (_HYBRID_KV_CACHE_GROUPS_ENABLED): it expects one page table per "
            f"KV cache group (page_tables_per_layer) and sliding-window groups, and ttserve serves every layer "
            f"from one page table: {fix}")


def kv_cache_problem(family: ModelFamily, model_path: Path | None, env: Mapping[str, str]) -> str | None:
    """Why the class cannot be served with ttserve's KV cache (one page table, one K/V shape for
    every layer), judged from the environment and the checkpoint's config.json before any import:
    - its hybrid KV cache groups switched on by the environment (HYBRID_KV_SWITCHES; the class
      reads the switch when it is imported, see `hybrid_kv_cache_problem` for the class itself);
    - layers of two attention types with different KV shapes: Gemma 4's full-attention layers keep
      `global_head_dim` and `num_global_key_value_heads` (512 and 4 on gemma-4-31B-it, beside 256
      and 16 for its sliding layers); the plugin gives each layer its own shape
      (get_kv_cache_spec -> allocate_kv_cache_per_layer), ttserve allocates one."""
    switch = next((var for prefix, var in HYBRID_KV_SWITCHES.items() if family.module.startswith(prefix)), None)
    if switch and env.get(switch, "0") != "0":
        return (f"{switch}={env[switch]}: {family.class_name} then runs vLLM's hybrid KV cache groups, one page "
                f"table per group (page_tables_per_layer) and sliding-window groups, and ttserve serves every "
                f"layer from one page table: unset {switch} (or set it to 0)")
    config = _text_config(model_path)
    pairs = (("head_dim", "global_head_dim"), ("num_key_value_heads", "num_global_key_value_heads"))
    differ = [f"{key} {config[key]} vs {other} {config[other]}" for key, other in pairs
              if isinstance(config.get(key), int) and isinstance(config.get(other), int)
              and config[other] != config[key]]
    if differ:
        return (f"{model_path} has layers with two KV cache shapes ({', '.join(differ)} for its full-attention "
                f"layers): {family.class_name} needs a KV cache shaped per layer, as the TT plugin allocates it "
                "(get_kv_cache_spec, allocate_kv_cache_per_layer), and ttserve allocates one shape for every layer")
    return None


def _text_config(model_path: Path | None) -> dict[str, Any]:
    """config.json's language-model settings (a nested text_config over the top level), or {}."""
    import json
    if model_path is None:
        return {}
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(config, dict):
        return {}
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, dict) else config


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
    why = _TAKES_OTHER_IMAGES.get(class_name)
    if why:
        return f"{class_name} {why}: serve a model that takes pixel_values (Qwen2.5-VL, Qwen3-VL, Gemma 3)"
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
