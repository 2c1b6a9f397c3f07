"""The model registry (worker/planning/registry.py): TT<Arch> entries matched by declared architecture,
built-ins per backend, the Galaxy selectors, EXTRA_MODELS_DIR bundles, TT_VLLM_BUILTIN_MODELS,
and one end-to-end run of a bundle-provided model through a real worker and control plane."""
from __future__ import annotations

import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest

from ttserve.worker.planning import registry as reg
from ttserve.worker.backends.torch.models import REFERENCE_ARCHITECTURES
from ttserve.worker.backends.torch.models.llama import (
    TorchLlamaForCausalLM,
    TorchMistralForCausalLM,
    TorchQwen2ForCausalLM,
)
from ttserve.worker.planning.registry import (
    ModelLoadError,
    RegistryError,
    UnknownArchitecture,
    build_registry,
)

LOGGER = "ttserve.worker.registry"

# The reference models' architectures under TT names (worker/backends/torch/models).
TORCH_NAMES = sorted(reg.tt_name(arch) for arch in REFERENCE_ARCHITECTURES)

# A minimal class that speaks the generator contract (nothing runs through it here).
CONTRACT_CLASS = '''
class {name}:
    model_capabilities = {{"supports_prefix_caching": False}}

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len,
                              tt_data_parallel=1, **kwargs):
        return cls()

    def allocate_kv_cache(self, kv_cache_shape, dtype, num_layers):
        return []

    def prefill_forward(self, *args, **kwargs):
        return None

    def decode_forward(self, *args, **kwargs):
        return None

    def read_decode_output(self, out, async_read=False):
        return out

    def process_decode_output_host(self, out, is_tokens=False):
        return out
'''


@pytest.fixture(autouse=True)
def isolated_imports(tmp_path):
    """Bundles append folders to sys.path and import modules; undo both after each test."""
    path, modules = list(sys.path), set(sys.modules)
    yield
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if file.startswith(str(tmp_path)) or name == "models" or name.startswith("models."):
            del sys.modules[name]


def write_bundle(base: Path, folder: str, metadata: dict | str | None,
                 files: dict[str, str] | None = None) -> Path:
    path = base / folder
    path.mkdir(parents=True)
    if metadata is not None:
        text = metadata if isinstance(metadata, str) else json.dumps(metadata)
        (path / reg.METADATA_FILE).write_text(text)
    for name, source in (files or {}).items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(source)
    return path


def good_bundle(base: Path, folder: str, arch: str, module: str, cls: str = "Adapter") -> Path:
    return write_bundle(base, folder, {"arch": arch, "main_class": f"{module}:{cls}", "note": "extra"},
                        {f"{module}.py": CONTRACT_CLASS.format(name=cls)})


def warnings_naming(caplog, folder: Path) -> list[str]:
    """The registry's warnings about `folder` (a bundle, or an EXTRA_MODELS_DIR entry)."""
    subjects = (f"skipping bundle {folder}:", f"EXTRA_MODELS_DIR entry {folder} ")
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == LOGGER
            and any(subject in r.getMessage() for subject in subjects)]


# --- built-ins and matching ------------------------------------------------------------------

def test_torch_builtins_are_the_reference_models_under_tt_names():
    registry = build_registry("torch", {})
    assert registry.names() == TORCH_NAMES
    for arch, cls in REFERENCE_ARCHITECTURES.items():
        assert registry.resolve([arch]) == (arch, cls)
        assert registry.entry(arch).source == "torch"


def test_first_declared_architecture_with_an_entry_wins():
    registry = build_registry("torch", {})
    assert registry.resolve(["NoSuchForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM"]) == \
        ("Qwen2ForCausalLM", TorchQwen2ForCausalLM)
    assert registry.resolve(["LlamaForCausalLM", "Qwen2ForCausalLM"])[1] is TorchLlamaForCausalLM


def test_tt_prefix_is_added_and_a_tt_prefixed_declaration_matches_too():
    registry = build_registry("torch", {})
    assert "MistralForCausalLM" in registry and "TTMistralForCausalLM" in registry
    assert registry.resolve(["TTMistralForCausalLM"]) == ("TTMistralForCausalLM", TorchMistralForCausalLM)
    assert reg.tt_name("LlamaForCausalLM") == "TTLlamaForCausalLM"
    assert reg.tt_name("TTLlamaForCausalLM") == "TTLlamaForCausalLM"


def test_unknown_architecture_names_the_declared_and_lists_the_registered():
    registry = build_registry("torch", {})
    with pytest.raises(UnknownArchitecture) as e:
        registry.resolve(["GPT2LMHeadModel", "FalconForCausalLM"])
    message = str(e.value)
    assert "GPT2LMHeadModel, FalconForCausalLM" in message and "torch backend" in message
    assert f"registered: {', '.join(TORCH_NAMES)}" in message
    with pytest.raises(UnknownArchitecture, match=r"none declared"):
        registry.resolve([])
    assert isinstance(e.value, RegistryError) and isinstance(e.value, ValueError)


def test_unknown_backend_is_refused():
    with pytest.raises(RegistryError, match="backend 'cuda'.*torch, ttnn"):
        build_registry("cuda", {})


# --- ttnn: lazy tt-metal entries and the Galaxy selectors ------------------------------------

TT_TRANSFORMERS = "models.tt_transformers.tt.generator_vllm"
GALAXY = "models.demos.llama3_70b_galaxy.tt.generator_vllm"


def test_ttnn_entries_are_listed_without_importing_tt_metal():
    registry = build_registry("ttnn", {})
    assert {"TTLlamaForCausalLM", "TTQwen2ForCausalLM", "TTQwen3ForCausalLM", "TTMistralForCausalLM",
            "TTGptOssForCausalLM", "TTDeepseekV3ForCausalLM", *VISION_TARGETS, *PLUGIN_E3FC849_TARGETS} == \
        set(registry.names())
    assert all(isinstance(e.target, str) for e in registry.entries.values())
    assert not [m for m in sys.modules if m == "models" or m.startswith("models.")]
    # Selecting one imports it: tt-metal is absent here, which is a clear error naming the module.
    with pytest.raises(ModelLoadError) as e:
        registry.resolve(["LlamaForCausalLM"])
    assert f"{TT_TRANSFORMERS}:LlamaForCausalLM" in str(e.value) and "tt-metal" in str(e.value)


# The vision classes the TT plugin registers (vllm-tt-plugin platform.py), at the same paths.
VISION_TARGETS = {
    "TTMllamaForConditionalGeneration": f"{TT_TRANSFORMERS}:MllamaForConditionalGeneration",
    "TTQwen2_5_VLForConditionalGeneration":
        "models.demos.qwen25_vl.tt.generator_vllm:Qwen2_5_VLForConditionalGeneration",
    "TTQwen3VLForConditionalGeneration": "models.demos.qwen3_vl.tt.generator_vllm:Qwen3VLForConditionalGeneration",
    "TTMistral3ForConditionalGeneration": f"{TT_TRANSFORMERS}:Mistral3ForConditionalGeneration",
    "TTGemma3ForConditionalGeneration": f"{TT_TRANSFORMERS}:Gemma3ForConditionalGeneration",
}


def test_ttnn_vision_entries_name_the_plugins_classes():
    registry = build_registry("ttnn", {})
    assert {name: registry.entries[name].target for name in VISION_TARGETS} == VISION_TARGETS


@pytest.mark.parametrize("env, name, target", [
    ({}, "TTLlamaForCausalLM", f"{TT_TRANSFORMERS}:LlamaForCausalLM"),
    ({"TT_LLAMA_TEXT_VER": "tt_transformers"}, "TTLlamaForCausalLM", f"{TT_TRANSFORMERS}:LlamaForCausalLM"),
    ({"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"}, "TTLlamaForCausalLM", f"{GALAXY}:LlamaForCausalLM"),
    ({"TT_LLAMA_TEXT_VER": "llama2_70b"}, "TTLlamaForCausalLM",
     "models.demos.t3000.llama2_70b.tt.generator_vllm:TtLlamaForCausalLM"),
    ({}, "TTQwen3ForCausalLM", f"{TT_TRANSFORMERS}:QwenForCausalLM"),
    ({"TT_QWEN3_TEXT_VER": "qwen3_32b_galaxy"}, "TTQwen3ForCausalLM", f"{GALAXY}:QwenForCausalLM"),
    # A selector switches only its own family.
    ({"TT_QWEN3_TEXT_VER": "qwen3_32b_galaxy"}, "TTQwen2ForCausalLM", f"{TT_TRANSFORMERS}:QwenForCausalLM"),
    ({"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"}, "TTMistralForCausalLM",
     f"{TT_TRANSFORMERS}:MistralForCausalLM"),
])
def test_selectors_switch_the_galaxy_classes(env, name, target):
    entry = build_registry("ttnn", env).entries[name]
    assert entry.target == target


def test_selectors_leave_the_torch_reference_models_alone():
    registry = build_registry("torch", {"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"})
    assert registry.resolve(["LlamaForCausalLM"])[1] is TorchLlamaForCausalLM


@pytest.mark.parametrize("var, value, allowed", [
    ("TT_LLAMA_TEXT_VER", "llama3_70b", "tt_transformers, llama3_70b_galaxy, llama2_70b"),
    ("TT_QWEN3_TEXT_VER", "qwen3_galaxy", "tt_transformers, qwen3_32b_galaxy"),
])
def test_an_unknown_selector_value_names_the_allowed_ones(var, value, allowed):
    with pytest.raises(RegistryError) as e:
        build_registry("ttnn", {var: value})
    assert f"{var}={value!r}" in str(e.value) and allowed in str(e.value)


def test_the_selected_tt_metal_class_is_imported_when_resolved(tmp_path, monkeypatch):
    """A stand-in tt-metal tree on sys.path: only the chosen module is imported."""
    root = tmp_path / "tt-metal"
    for module in (TT_TRANSFORMERS, GALAXY):
        path = root / Path(*module.split("."))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".py").write_text(CONTRACT_CLASS.format(name="LlamaForCausalLM")
                                           + CONTRACT_CLASS.format(name="QwenForCausalLM"))
    monkeypatch.syspath_prepend(str(root))
    registry = build_registry("ttnn", {"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"})
    arch, cls = registry.resolve(["LlamaForCausalLM"])
    assert (arch, cls.__module__, cls.__name__) == ("LlamaForCausalLM", GALAXY, "LlamaForCausalLM")
    assert TT_TRANSFORMERS not in sys.modules
    assert registry.entry("LlamaForCausalLM").variant == "llama3_70b_galaxy"


# --- the plugin's registrations at e3fc849 that ttserve lacked: Gemma 4 and Qwen 3.5/3.6 ------------
# Classes from tests/fakes/tt_metal (each fake names the tt-metal file and version it mirrors).

GEMMA4 = "models.demos.gemma4.tt.generator_vllm"
QWEN36 = "models.demos.blackhole.qwen36.tt.qwen36_vllm"
TT_TREE = Path(__file__).parent / "fakes" / "tt_metal"

# vllm-tt-plugin @ e3fc849 platform.py:678-692 (TT_QWEN35_TEXT_VER) and :755-764.
PLUGIN_E3FC849_TARGETS = {
    "TTQwen3_5ForConditionalGeneration": f"{QWEN36}:Qwen36ForCausalLM",
    "TTGemma4ForCausalLM": f"{GEMMA4}:Gemma4ForCausalLM",
    "TTGemma4ForConditionalGeneration": f"{GEMMA4}:Gemma4ForCausalLM",
    "TTGemma4UnifiedForConditionalGeneration": f"{GEMMA4}:Gemma4ForCausalLM",
}


@pytest.fixture
def fake_tt_metal(monkeypatch):
    """tests/fakes/tt_metal on sys.path, its modules imported afresh (isolated_imports drops them)."""
    for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(TT_TREE))


def test_the_plugins_gemma4_and_qwen35_entries_are_registered():
    registry = build_registry("ttnn", {})
    assert {name: registry.entries[name].target for name in PLUGIN_E3FC849_TARGETS} == PLUGIN_E3FC849_TARGETS
    assert registry.entry("Qwen3_5ForConditionalGeneration").variant == "qwen36_blackhole"
    assert not [m for m in sys.modules if m == "models" or m.startswith("models.")]


@pytest.mark.parametrize("arch, module, cls_name", [
    ("Gemma4ForCausalLM", GEMMA4, "Gemma4ForCausalLM"),
    ("Gemma4ForConditionalGeneration", GEMMA4, "Gemma4ForCausalLM"),
    ("Gemma4UnifiedForConditionalGeneration", GEMMA4, "Gemma4ForCausalLM"),
    ("TTGemma4ForConditionalGeneration", GEMMA4, "Gemma4ForCausalLM"),
    ("Qwen3_5ForConditionalGeneration", QWEN36, "Qwen36ForCausalLM"),
    ("TTQwen3_5ForConditionalGeneration", QWEN36, "Qwen36ForCausalLM"),
])
def test_each_new_architecture_resolves_to_the_plugins_class(fake_tt_metal, arch, module, cls_name):
    resolved, cls = build_registry("ttnn", {}).resolve([arch])
    assert (resolved, cls.__module__, cls.__name__) == (arch, module, cls_name)


def test_an_unknown_qwen35_version_names_the_plugins_only_one():
    with pytest.raises(RegistryError, match=r"TT_QWEN35_TEXT_VER='qwen35_galaxy'.*choose one of qwen36_blackhole$"):
        build_registry("ttnn", {"TT_QWEN35_TEXT_VER": "qwen35_galaxy"})


def test_gemma4_and_qwen36_import_vllm_gemma4_through_tt_transformers(fake_tt_metal):
    from ttserve.worker.backends.ttnn.tt_models import module_imports_vllm
    assert module_imports_vllm(QWEN36) is True   # at its own top
    assert module_imports_vllm(GEMMA4) is True   # HybridAttentionForCausalLM's module imports it
    assert not [m for m in sys.modules if m == "models" or m.startswith("models.")]


# Refusals before any weight loads: ttserve serves every layer from one page table and one KV shape.

PER_LAYER_ONLY_CLASS = '''
class PerLayerOnly:
    model_capabilities = {}

    @classmethod
    def initialize_vllm_model(cls, hf_config, mesh_device, max_batch_size, max_seq_len, tt_data_parallel=1):
        return cls()

    def allocate_kv_cache_per_layer(self, per_layer_specs):
        return []

    def prefill_forward(self, *args, page_tables_per_layer=None, **kwargs):
        return None

    def decode_forward(self, *args, page_tables_per_layer=None, **kwargs):
        return None

    def read_decode_output(self, out, async_read=False):
        return out
'''


def test_a_class_with_only_a_per_layer_kv_cache_is_refused_naming_what_it_needs(tmp_path):
    base = tmp_path / "bundles"
    folder = write_bundle(base, "hybrid",
                          {"arch": "HybridOnlyForCausalLM", "main_class": "per_layer_only:PerLayerOnly"},
                          {"per_layer_only.py": PER_LAYER_ONLY_CLASS})
    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})
    with pytest.raises(ModelLoadError) as e:
        registry.resolve(["HybridOnlyForCausalLM"])
    message = str(e.value)
    assert str(folder) in message
    for part in ("allocate_kv_cache_per_layer, no allocate_kv_cache", "page_tables_per_layer", "one page table"):
        assert part in message, message


def test_gemma4_with_its_hybrid_kv_cache_groups_switched_on_does_not_load(fake_tt_metal, monkeypatch):
    # The real class reads the switch when its module is imported (generator_vllm.py @ 00b97ff1).
    monkeypatch.setenv("GEMMA4_HYBRID_KV_CACHE_GROUPS", "1")
    with pytest.raises(ModelLoadError) as e:
        build_registry("ttnn", {}).resolve(["Gemma4ForConditionalGeneration"])
    message = str(e.value)
    assert "_HYBRID_KV_CACHE_GROUPS_ENABLED" in message and "unset GEMMA4_HYBRID_KV_CACHE_GROUPS" in message, message


def test_gemma4_with_the_switch_off_loads_as_the_plugin_serves_it(fake_tt_metal, monkeypatch):
    monkeypatch.setenv("GEMMA4_HYBRID_KV_CACHE_GROUPS", "0")
    _, cls = build_registry("ttnn", {}).resolve(["Gemma4ForConditionalGeneration"])
    assert cls._HYBRID_KV_CACHE_GROUPS_ENABLED is False
    assert callable(cls.allocate_kv_cache) and callable(cls.allocate_kv_cache_per_layer)


def gemma4_checkpoint(root: Path, arch: str = "Gemma4ForConditionalGeneration", **text) -> Path:
    """A gemma-4-31B-it-shaped config.json (tt-metal models/demos/gemma4/configs), 4 layers."""
    folder = root / "gemma-4-it"
    folder.mkdir(parents=True)
    text_config = {"model_type": "gemma4_text", "head_dim": 256, "global_head_dim": 512, "num_key_value_heads": 16,
                   "num_global_key_value_heads": 4, "num_attention_heads": 32, "hidden_size": 512,
                   "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 64, "sliding_window": 1024,
                   "max_position_embeddings": 262144,
                   "layer_types": ["sliding_attention"] * 3 + ["full_attention"], **text}
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "gemma4", "text_config": text_config, "eos_token_id": [1, 106],
        "vision_config": {"model_type": "gemma4_vision", "hidden_size": 64}}))
    return folder


def qwen35_checkpoint(root: Path) -> Path:
    folder = root / "Qwen3.5-9B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
        "text_config": {"model_type": "qwen3_5_text", "head_dim": 256, "num_key_value_heads": 4,
                        "num_attention_heads": 16, "hidden_size": 512, "num_hidden_layers": 4, "vocab_size": 64,
                        "max_position_embeddings": 262144,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "rope_parameters": {"mrope_section": [11, 11, 10], "rope_type": "default"}},
        "vision_config": {"model_type": "qwen3_5", "hidden_size": 64}, "image_token_id": 248056}))
    return folder


def ttnn_plan(model_dir: Path, env: dict, *flags: str, serving=None):
    """The worker's plan on a host without chips (MESH_DEVICE names the mesh)."""
    import argparse

    from ttserve.worker import config as worker_config
    from ttserve.worker.backends.ttnn.mesh_device import ChipProbe
    from ttserve.worker.planning.preflight import plan_worker

    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    args = worker_config.parse_args(parser, ["--backend", "ttnn", "--model", str(model_dir), *flags])
    return plan_worker(args, env, serving=serving, need_hardware=False,
                       probe=lambda: ChipProbe(False, "no Tenstorrent chips detected on this host"))


def test_the_gemma4_switch_in_the_workers_environment_is_refused_in_the_plan(fake_tt_metal, tmp_path):
    from ttserve.worker.planning.preflight import Serving
    model_dir = gemma4_checkpoint(tmp_path, global_head_dim=None, num_global_key_value_heads=None)
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x4", "GEMMA4_HYBRID_KV_CACHE_GROUPS": "1"},
                     serving=Serving(max_num_seqs=8))
    [refusal] = plan.fatal
    assert refusal.startswith("GEMMA4_HYBRID_KV_CACHE_GROUPS=1: Gemma4ForCausalLM then runs vLLM's hybrid KV"), refusal
    assert "unset GEMMA4_HYBRID_KV_CACHE_GROUPS" in refusal
    # The same checkpoint without the switch plans cleanly, with the class loaded from the tree.
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x4"}, serving=Serving(max_num_seqs=8))
    assert not plan.fatal, plan.fatal
    assert plan.entry.target_name == f"{GEMMA4}:Gemma4ForCausalLM" and plan.model_cls.__name__ == "Gemma4ForCausalLM"
    assert plan.environment.to_set == {}  # it reads hf_config._name_or_path (--model), no variable


def test_a_gemma4_checkpoint_with_two_kv_shapes_is_refused_before_weights_load(fake_tt_metal, tmp_path):
    # gemma-4-31B-it: sliding layers head_dim 256 x 16 KV heads, full layers 512 x 4; the plugin
    # allocates each layer its own shape, ttserve one shape for all.
    model_dir = gemma4_checkpoint(tmp_path)
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x8"})
    [refusal] = plan.fatal
    assert "head_dim 256 vs global_head_dim 512, num_key_value_heads 16 vs num_global_key_value_heads 4" in refusal
    assert "allocate_kv_cache_per_layer" in refusal and "one shape for every layer" in refusal


def test_the_backends_check_refuses_the_gemma4_switch_before_initialize(fake_tt_metal, monkeypatch, tmp_path):
    from fakes.fake_ttnn import FakeTtnn

    from ttserve.worker.backends.ttnn.backend import TtnnBackend
    from ttserve.worker.batch import ServingConfig
    from ttserve.worker.planning.mesh import resolve_mesh

    _, cls = build_registry("ttnn", {}).resolve(["Gemma4ForCausalLM"])
    model_dir = gemma4_checkpoint(tmp_path, global_head_dim=None, num_global_key_value_heads=None)
    config = ServingConfig(num_lanes=1, max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=4096)
    backend = TtnnBackend(resolve_mesh("P150x4", 4), {}, env={"GEMMA4_HYBRID_KV_CACHE_GROUPS": "true"},
                          ttnn=FakeTtnn())
    with pytest.raises(ValueError, match="GEMMA4_HYBRID_KV_CACHE_GROUPS=true: Gemma4ForCausalLM then runs"):
        backend.check(cls, model_dir, config)
    TtnnBackend(resolve_mesh("P150x4", 4), {}, env={}, ttnn=FakeTtnn()).check(cls, model_dir, config)


@pytest.mark.parametrize("value", ["performance", "accuracy"])
def test_gemma4_takes_the_optimizations_its_class_accepts(fake_tt_metal, tmp_path, value):
    # Gemma4ForCausalLM.initialize_vllm_model: None, "performance" or "accuracy", else ValueError.
    model_dir = gemma4_checkpoint(tmp_path, global_head_dim=None, num_global_key_value_heads=None)
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x4"}, "--additional-config.tt.optimizations", value)
    assert not plan.fatal, plan.fatal
    with pytest.raises(ValueError, match=r"None\|performance\|accuracy"):
        plan.model_cls.initialize_vllm_model(None, None, 8, 4096, optimizations="fast")


def test_qwen36_reads_hf_model_and_refuses_another_model_weights_dir(fake_tt_metal, tmp_path):
    from ttserve.worker.planning.preflight import Serving
    model_dir = qwen35_checkpoint(tmp_path)
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x4"}, serving=Serving(max_num_seqs=8))
    assert not plan.fatal, plan.fatal
    assert plan.entry.variant == "qwen36_blackhole" and plan.model_cls.__name__ == "Qwen36ForCausalLM"
    assert plan.environment.to_set == {"HF_MODEL": str(model_dir)}
    other = tmp_path / "Qwen3.6-27B"
    plan = ttnn_plan(model_dir, {"MESH_DEVICE": "P150x4", "MODEL_WEIGHTS_DIR": str(other)})
    assert any(p.startswith(f"MODEL_WEIGHTS_DIR={other} names another checkpoint than --model") for p in plan.fatal), \
        plan.problems


def test_the_qwen36_fake_loads_the_folder_the_plugins_order_picks(fake_tt_metal, monkeypatch, tmp_path):
    """MODEL_WEIGHTS_DIR, then HF_MODEL, then hf_config._name_or_path, written to HF_MODEL."""
    from types import SimpleNamespace

    from fakes.fake_ttnn import FakeMesh
    monkeypatch.delenv("MODEL_WEIGHTS_DIR", raising=False)
    monkeypatch.setenv("HF_MODEL", "/weights/hf-model")
    _, cls = build_registry("ttnn", {}).resolve(["Qwen3_5ForConditionalGeneration"])
    from models.tt_transformers.tt.generator import TTNN
    hf_config = SimpleNamespace(_name_or_path="/weights/name-or-path")
    cls.initialize_vllm_model(hf_config, FakeMesh(TTNN.recorder, "mesh", 4), 8, 4096, tt_data_parallel=2)
    monkeypatch.setenv("MODEL_WEIGHTS_DIR", "/weights/dir")
    cls.initialize_vllm_model(hf_config, FakeMesh(TTNN.recorder, "mesh", 4), 8, 4096)
    built = TTNN.recorder.only("model.qwen36_create_tt_model")
    assert [(b["hf_model"], b["num_devices"], b["max_batch_size"]) for b in built] == \
        [("/weights/hf-model", 4, 8), ("/weights/dir", 4, 8)]  # one model, whatever tt_data_parallel
    assert os.environ["HF_MODEL"] == "/weights/dir"


def test_qwen36_lane_and_batch_rules():
    from ttserve.worker.backends.ttnn.tt_models import ModelFamily, data_parallel_problem
    from ttserve.worker.planning.mesh import resolve_mesh
    family = ModelFamily.of(f"{QWEN36}:Qwen36ForCausalLM", "qwen36_blackhole")
    p150, p150x4 = resolve_mesh("P150", 1), resolve_mesh("P150x4", 4)
    assert data_parallel_problem(family, 1, 1, p150) is None
    assert data_parallel_problem(family, 1, 32, p150x4) is None
    one_device = data_parallel_problem(family, 1, 2, p150)
    assert "--max-num-seqs 2" in one_device and "use --max-num-seqs 1" in one_device
    assert "supports batch sizes 1, 2, 4, 8, 16, 32" in data_parallel_problem(family, 1, 12, p150x4)
    lanes = data_parallel_problem(family, 2, 8, p150x4)
    assert "ignores tt_data_parallel" in lanes and lanes.endswith("use --data-parallel-size 1")


def test_qwen36_takes_no_optimizations(fake_tt_metal, tmp_path):
    plan = ttnn_plan(qwen35_checkpoint(tmp_path), {"MESH_DEVICE": "P150x4"},
                     "--additional-config.tt.optimizations", "performance")
    assert any("takes no custom optimizations (it ignores them)" in p for p in plan.fatal), plan.problems


def test_qwen36_states_its_kv_budget_and_capabilities(fake_tt_metal, monkeypatch, tmp_path):
    from ttserve.worker.planning.preflight import Serving
    monkeypatch.delenv("QWEN36_MAX_TOKENS_ALL_USERS", raising=False)
    plan = ttnn_plan(qwen35_checkpoint(tmp_path), {"MESH_DEVICE": "P150x4"},
                     serving=Serving(max_num_seqs=8, max_model_len=65536))
    assert not plan.fatal, plan.fatal
    assert any("524800 tokens per lane = 524288 (Qwen36ForCausalLM.get_max_tokens_all_users" in line
               for line in plan.lines), plan.lines
    caps = plan.model_cls.model_capabilities
    assert (caps["supports_prefix_caching"], caps["supports_async_decode"], caps["supports_sample_on_device"]) == \
        (False, False, True)


# --- EXTRA_MODELS_DIR bundles ----------------------------------------------------------------

def test_bundles_register_and_malformed_ones_are_skipped_with_one_warning_each(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=LOGGER)
    base = tmp_path / "bundles"
    good = good_bundle(base, "a-good", "GoodChatForCausalLM", "good_chat_adapter", "GoodChat")
    prefixed = good_bundle(base, "b-prefixed", "TTOtherForCausalLM", "other_adapter")
    bad = {
        "no-metadata": write_bundle(base, "no-metadata", None, {"x_adapter.py": "X = 1\n"}),
        "invalid-json": write_bundle(base, "invalid-json", '{"arch": "BrokenForCausalLM",'),
        "not-an-object": write_bundle(base, "not-an-object", '["BrokenForCausalLM"]'),
        "missing-field": write_bundle(base, "missing-field", {"arch": "NoClassForCausalLM"}),
        "bad-main-class": write_bundle(base, "bad-main-class",
                                       {"arch": "ColonlessForCausalLM", "main_class": "adapter.Class"}),
        "import-error": write_bundle(
            base, "import-error", {"arch": "ImportFailsForCausalLM", "main_class": "import_fails_adapter:A"},
            {"import_fails_adapter.py": "import ttnn_that_is_not_installed\n"}),
        "syntax-error": write_bundle(
            base, "syntax-error", {"arch": "SyntaxForCausalLM", "main_class": "syntax_adapter:A"},
            {"syntax_adapter.py": "class A(:\n"}),
        "missing-class": write_bundle(
            base, "missing-class", {"arch": "MissingForCausalLM", "main_class": "missing_adapter:Absent"},
            {"missing_adapter.py": CONTRACT_CLASS.format(name="Present")}),
        "no-contract": write_bundle(
            base, "no-contract", {"arch": "HalfForCausalLM", "main_class": "half_adapter:Half"},
            {"half_adapter.py": "class Half:\n    def prefill_forward(self):\n        pass\n"}),
        "z-duplicate": good_bundle(base, "z-duplicate", "GoodChatForCausalLM", "dup_adapter"),
    }
    (base / "README.txt").write_text("not a bundle\n")  # plain files and hidden folders are ignored
    (base / ".cache").mkdir()

    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})

    assert registry.names() == sorted(TORCH_NAMES + ["TTGoodChatForCausalLM", "TTOtherForCausalLM"])
    arch, cls = registry.resolve(["GoodChatForCausalLM"])
    assert (arch, cls.__name__, cls.__module__) == ("GoodChatForCausalLM", "GoodChat", "good_chat_adapter")
    assert registry.resolve(["OtherForCausalLM"])[1].__module__ == "other_adapter"
    assert registry.entry("GoodChatForCausalLM").source == str(good)
    assert registry.entry("OtherForCausalLM").source == str(prefixed)
    assert not warnings_naming(caplog, good) and not warnings_naming(caplog, prefixed)
    expected = {
        "no-metadata": "no vllm_metadata.json",
        "invalid-json": "cannot read vllm_metadata.json",
        "not-an-object": "must hold a JSON object",
        "missing-field": "lacks 'main_class'",
        "bad-main-class": "'main_class' must be \"module:Class\"",
        "import-error": "ModuleNotFoundError: No module named 'ttnn_that_is_not_installed'",
        "syntax-error": "SyntaxError",
        "missing-class": "AttributeError",
        "no-contract": "no initialize_vllm_model, allocate_kv_cache, decode_forward, read_decode_output",
        "z-duplicate": "TTGoodChatForCausalLM is already provided by bundle " + str(good),
    }
    for name, folder in bad.items():
        found = warnings_naming(caplog, folder)
        assert len(found) == 1, (name, found)
        assert expected[name] in found[0], (name, found[0])
        assert expected[name] in registry.skipped[str(folder)]
    assert set(registry.skipped) == {str(f) for f in bad.values()}
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "README" in r.getMessage()]


def test_serving_the_architecture_of_a_broken_bundle_is_a_clear_error(tmp_path):
    base = tmp_path / "bundles"
    broken = write_bundle(base, "broken", {"arch": "BrokenForCausalLM", "main_class": "broken_adapter:B"},
                          {"broken_adapter.py": "raise RuntimeError('needs a Galaxy')\n"})
    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})  # the worker still starts
    with pytest.raises(ModelLoadError) as e:
        registry.resolve(["BrokenForCausalLM"])
    assert str(broken) in str(e.value) and "RuntimeError: needs a Galaxy" in str(e.value)
    assert "TTBrokenForCausalLM" not in registry.names()
    assert registry.resolve(["LlamaForCausalLM"])[1] is TorchLlamaForCausalLM  # others unaffected


def test_a_bundle_overrides_the_builtin_of_its_architecture(tmp_path):
    base = tmp_path / "bundles"
    folder = good_bundle(base, "llama", "LlamaForCausalLM", "my_llama_adapter", "MyLlama")
    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})
    assert registry.names() == TORCH_NAMES
    assert registry.resolve(["LlamaForCausalLM"])[1].__name__ == "MyLlama"
    assert registry.entry("LlamaForCausalLM").source == str(folder)


def test_several_bundle_dirs_earlier_ones_win_and_a_missing_dir_is_a_warning(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger=LOGGER)
    first, second, missing = tmp_path / "one", tmp_path / "two", tmp_path / "absent"
    good_bundle(first, "x", "SharedForCausalLM", "shared_first_adapter", "First")
    good_bundle(second, "x", "SharedForCausalLM", "shared_second_adapter", "Second")
    good_bundle(second, "y", "OnlyTwoForCausalLM", "only_two_adapter")
    env = {"EXTRA_MODELS_DIR": os.pathsep.join([str(missing), str(first), str(second)])}
    registry = build_registry("torch", env)
    assert registry.resolve(["SharedForCausalLM"])[1].__name__ == "First"
    assert "TTOnlyTwoForCausalLM" in registry.names()
    assert len(warnings_naming(caplog, missing)) == 1
    assert len(warnings_naming(caplog, second / "x")) == 1


def test_bundle_modules_of_the_same_name_do_not_silently_share_one_class(tmp_path, caplog):
    """Both bundles ship adapter_same.py: the second would import the first's module from
    sys.modules and serve the wrong class; it is skipped instead."""
    caplog.set_level(logging.WARNING, logger=LOGGER)
    base = tmp_path / "bundles"
    good_bundle(base, "a", "AlphaForCausalLM", "adapter_same", "Alpha")
    clash = good_bundle(base, "b", "BetaForCausalLM", "adapter_same", "Beta")
    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})
    assert registry.resolve(["AlphaForCausalLM"])[1].__name__ == "Alpha"
    [warning] = warnings_naming(caplog, clash)
    assert "'adapter_same' is shadowed by" in warning
    with pytest.raises(ModelLoadError, match="shadowed"):
        registry.resolve(["BetaForCausalLM"])


def test_a_bundle_may_name_an_installed_module(tmp_path):
    base = tmp_path / "bundles"
    write_bundle(base, "alias", {"arch": "AliasForCausalLM",
                                 "main_class": "ttserve.worker.backends.torch.models.llama:TorchQwen2ForCausalLM"})
    registry = build_registry("torch", {"EXTRA_MODELS_DIR": str(base)})
    assert registry.resolve(["AliasForCausalLM"])[1] is TorchQwen2ForCausalLM


@pytest.mark.parametrize("value", ["0", "false", "OFF", " no "])
def test_builtin_models_off_leaves_only_the_bundles(tmp_path, value):
    base = tmp_path / "bundles"
    good_bundle(base, "only", "OnlyForCausalLM", "only_adapter")
    for backend in ("torch", "ttnn"):
        registry = build_registry(backend, {"EXTRA_MODELS_DIR": str(base), "TT_VLLM_BUILTIN_MODELS": value,
                                            "TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"})
        assert registry.names() == ["TTOnlyForCausalLM"]
        with pytest.raises(UnknownArchitecture, match=r"registered: TTOnlyForCausalLM$"):
            registry.resolve(["LlamaForCausalLM"])


@pytest.mark.parametrize("value", ["1", "true", ""])
def test_builtin_models_stay_on_otherwise(value):
    assert build_registry("torch", {"TT_VLLM_BUILTIN_MODELS": value}).names() == TORCH_NAMES


def test_skipped_bundles_are_mentioned_when_nothing_matches(tmp_path):
    base = tmp_path / "bundles"
    write_bundle(base, "empty", {})
    with pytest.raises(UnknownArchitecture, match=r"1 bundle\(s\) under EXTRA_MODELS_DIR were skipped"):
        build_registry("torch", {"EXTRA_MODELS_DIR": str(base)}).resolve(["NewForCausalLM"])


# --- end to end: a bundle-provided model served by a real worker ------------------------------

TINYCHAT_ADAPTER = '''"""SmolLM2's weights under a new architecture name, from an EXTRA_MODELS_DIR bundle."""
from ttserve.worker.backends.torch.models.llama import TorchLlamaForCausalLM


class TinyChatForCausalLM(TorchLlamaForCausalLM):
    """The torch reference Llama under the architecture TinyChatForCausalLM."""
'''


def tinychat_checkpoint(smollm2: Path, folder: Path) -> Path:
    """A copy of the SmolLM2 folder declaring TinyChatForCausalLM; the weights are symlinked."""
    folder.mkdir()
    for item in smollm2.iterdir():
        if item.suffix == ".safetensors":
            (folder / item.name).symlink_to(item.resolve())
        elif item.is_file():
            shutil.copy2(item, folder / item.name)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["TinyChatForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def reference_greedy(model_dir: Path, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens of the built-in reference model, driven in-process through the contract."""
    import torch

    config = json.loads((model_dir / "config.json").read_text())
    model = TorchLlamaForCausalLM.initialize_vllm_model(
        config, torch.device("cpu"), 1, 128, model_path=str(model_dir))
    s = model.shape
    block = 64
    kv = model.allocate_kv_cache((2, s.num_kv_heads, block, s.head_dim), torch.float32, s.num_layers)
    page_table = torch.tensor([[0, 1]], dtype=torch.int32)
    logits = model.prefill_forward(torch.tensor([prompt]), page_table, kv, [len(prompt)])
    out = [int(logits[0, -1].argmax())]
    while len(out) < new_tokens:
        position = len(prompt) + len(out) - 1
        logits = model.decode_forward(torch.tensor([[out[-1]]]), torch.tensor([position]), page_table, kv)
        out.append(int(logits[0, -1].argmax()))
    return out


@pytest.mark.e2e
def test_bundle_model_end_to_end(tmp_path, smollm2):
    from stack import start_stack
    from ttserve.control_client import ControlClient

    bundles = tmp_path / "bundles"
    write_bundle(bundles, "tinychat", {"arch": "TinyChatForCausalLM",
                                       "main_class": "tinychat_adapter:TinyChatForCausalLM"},
                 {"tinychat_adapter.py": TINYCHAT_ADAPTER})
    model = tinychat_checkpoint(smollm2, tmp_path / "TinyChat-135M")
    prompt, new_tokens = [1, 504, 3458, 282, 4649, 314], 12

    stack = start_stack(tmp_path, str(model), gateway=False, env={"EXTRA_MODELS_DIR": str(bundles)},
                        control_flags=("--max-num-seqs", "2"),
                        # float32: the reference below is float32, and bf16 greedy tokens may
                        # part from it at a near-tie
                        worker_flags=("--kv-cache-memory-bytes", str(64 << 20), "--dtype", "float32"))
    try:
        client = ControlClient(stack.control_address)
        try:
            assert client.model_info().architecture == "TinyChatForCausalLM"
            client.add("tiny", prompt, new_tokens, ignore_eos=True)
            served = client.collect({"tiny"})["tiny"].token_ids
        finally:
            client.close()
    finally:
        stack.stop()
    assert served == reference_greedy(smollm2, prompt, new_tokens), stack.logs()
