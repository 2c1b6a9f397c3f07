"""The ttnn path against tt-metal's and the TT vLLM plugin's real behaviour, one test per row of
the contract (README "Tenstorrent hosts"), on fakes that mirror the real files: tests/fakes/
tt_metal (tt-metal's `models/` tree: generator_vllm importing vLLM at its top, ModelArgs asserting
HF_MODEL, the Galaxy generator's divisibility assert and 32-device model args,
get_max_tokens_all_users) and
tests/fakes/fake_tt_model.py (resume-offset flooring that rewrites the tokens before start_pos,
the 32-candidate device sampler, the decode input-update contract)."""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fakes import fake_tt_generator
from fakes.fake_tt_model import make_model_class
from fakes.fake_ttnn import FabricConfig, FakeTtnn

from ttserve.worker import config as worker_config
from ttserve.worker.backends.ttnn.backend import TtnnBackend
from ttserve.worker.backends.ttnn.mesh_device import ChipProbe
from ttserve.worker.batch import DecodeItem, NewRequest, PrefillChunk, ServingConfig, StepBatch
from ttserve.worker.planning.mesh import fabric_for, resolve_mesh
from ttserve.worker.planning.preflight import Serving, plan_worker
from ttserve.worker.planning.registry import ModelLoadError, build_registry
from ttserve.worker.runner import DeviceOptions, ModelRunner
from ttserve.worker.server import DeviceService

TREE = Path(__file__).parent / "fakes" / "tt_metal"
TESTS = Path(__file__).parent
GALAXY_ENV = {"TT_LLAMA_TEXT_VER": "llama3_70b_galaxy"}
QWEN_GALAXY_ENV = {"TT_QWEN3_TEXT_VER": "qwen3_32b_galaxy"}
GALAXY = "models.demos.llama3_70b_galaxy.tt.generator_vllm"
# TtnnBackend.null_block: device block 0 takes the model's padding, so the device block of the
# control plane's block b is b + NULL, and one block of the model's budget is not handed out.
NULL = 1


@pytest.fixture
def tt_metal(monkeypatch):
    """tt-metal's models/ tree (the fake) importable for one test; each test imports it afresh."""
    def loaded() -> set[str]:
        return {m for m in sys.modules if m == "models" or m.startswith("models.")}

    before = loaded()
    for name in before:  # e.g. fake_tt_generator's stand-ins: hidden for the length of the test
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(TREE))
    yield
    for name in loaded():
        del sys.modules[name]


@pytest.fixture
def no_vllm(monkeypatch):
    """vLLM as an uninstalled package looks to import and find_spec (a None in sys.modules)."""
    for name in [m for m in sys.modules if m == "vllm" or m.startswith("vllm.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "vllm", None)


@pytest.fixture
def no_hf_model(monkeypatch):
    """HF_MODEL (and LLAMA_DIR) unset, and restored after: the worker sets them in os.environ."""
    for var in ("HF_MODEL", "LLAMA_DIR"):
        monkeypatch.setenv(var, "placeholder")
        monkeypatch.delenv(var)


def checkpoint(root: Path, name: str = "Llama-3.1-8B-Instruct", arch: str = "LlamaForCausalLM") -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "architectures": [arch], "model_type": "llama", "vocab_size": 64, "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
        "max_position_embeddings": 131072, "eos_token_id": 2}))
    return folder


def tree_runner(model_dir: Path, cls_path: str, mesh: str, *, env=None, variant=None, block_size=64,
                **tt) -> tuple[ModelRunner, FakeTtnn]:
    import importlib
    module, _, name = cls_path.partition(":")
    cls = getattr(importlib.import_module(module), name)
    from models.tt_transformers.tt.generator import TTNN
    spec = resolve_mesh(mesh, 32)
    backend = TtnnBackend(spec, tt, variant=variant, env=env if env is not None else os.environ, ttnn=TTNN)
    runner = ModelRunner(model_dir, cls, "LlamaForCausalLM", backend, torch.bfloat16,
                         block_size=block_size, kv_cache_bytes=0, options=DeviceOptions(tt, backend_traces=True))
    return runner, TTNN


def warm(runner: ModelRunner, num_lanes=1, max_num_seqs=1, max_model_len=4096) -> None:
    runner.warmup(ServingConfig(num_lanes=num_lanes, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                max_num_batched_tokens=max_model_len), lambda *_: None)


def chips(num_devices: int = 1, cluster: str = "N150") -> ChipProbe:
    return ChipProbe(True, f"{num_devices} wormhole_b0 chip(s), cluster {cluster}", num_devices, "wormhole_b0",
                     cluster in ("GALAXY", "TG"), cluster)


def worker_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    worker_config.add_arguments(parser)
    return worker_config.parse_args(parser, list(argv))


# ---- vLLM at the top of generator_vllm.py -----------------------------------------------------

def test_a_missing_vllm_is_named_with_its_fix_not_blamed_on_pythonpath(tt_metal, no_vllm):
    with pytest.raises(ModelLoadError) as e:
        build_registry("ttnn", {}).resolve(["LlamaForCausalLM"])
    message = str(e.value)
    assert "imports vLLM at its top" in message and "install-vllm-tt.sh" in message, message
    assert "PYTHONPATH" not in message and "\n" not in message


def test_the_galaxy_generator_imports_no_vllm_and_is_not_refused_without_it(tt_metal, no_vllm, no_hf_model,
                                                                           tmp_path):
    # tt-metal's Galaxy generator_vllm dropped its `import vllm.envs`; only older versions need vLLM.
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(checkpoint(tmp_path))),
                       {**GALAXY_ENV, "MESH_DEVICE": "TG"}, serving=Serving(data_parallel_size=4, max_num_seqs=8),
                       probe=lambda: chips(32, "GALAXY"))
    assert not plan.fatal, plan.fatal
    assert plan.model_cls is not None and plan.model_cls.__module__ == GALAXY


def test_whether_a_module_imports_vllm_is_read_from_its_source(tt_metal, tmp_path, monkeypatch):
    from ttserve.worker.backends.ttnn.tt_models import module_imports_vllm
    assert module_imports_vllm("models.tt_transformers.tt.generator_vllm") is True
    assert module_imports_vllm(GALAXY) is False
    assert module_imports_vllm("models.demos.nowhere.tt.generator_vllm") is None  # not found: not judged
    # An older tt-metal first on the path (up to 0be6ffc8 the module did `import vllm.envs as envs`).
    package = tmp_path / "old_tt"
    package.mkdir()
    for part in ("models", "demos", "llama3_70b_galaxy", "tt"):
        package = package / part
        package.mkdir()
        (package / "__init__.py").write_text("raise RuntimeError('a package ran')\n")
    (package / "generator_vllm.py").write_text("import ttnn\nimport vllm.envs as envs\n")
    monkeypatch.syspath_prepend(str(tmp_path / "old_tt"))
    assert module_imports_vllm(GALAXY) is True
    assert "models" not in sys.modules  # found and read, nothing imported


def test_with_vllm_the_built_in_classes_import_from_tt_metal(tt_metal):
    _, cls = build_registry("ttnn", {}).resolve(["LlamaForCausalLM"])
    assert cls.__module__ == "models.tt_transformers.tt.generator_vllm" and cls.__name__ == "LlamaForCausalLM"


def test_the_worker_refuses_to_start_without_vllm_in_one_line(tt_metal, no_vllm, tmp_path):
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(checkpoint(tmp_path))), {},
                       probe=lambda: chips())
    assert any("imports vLLM at its top" in p and "VLLM_TARGET_DEVICE=empty" in p for p in plan.fatal), plan.problems
    assert all("\n" not in p for p in plan.fatal)


# ---- HF_MODEL: ModelArgs refuses to build without it -----------------------------------------

def test_hf_model_is_set_from_model_before_tt_metal_builds_its_model_args(tt_metal, no_hf_model, tmp_path):
    model_dir = checkpoint(tmp_path)
    runner, ttnn = tree_runner(model_dir, "models.tt_transformers.tt.generator_vllm:LlamaForCausalLM", "N150")
    warm(runner)
    assert os.environ["HF_MODEL"] == str(model_dir)
    assert ttnn.recorder.only("model.initialize_vllm_model")


def test_an_hf_model_naming_other_weights_is_refused_before_the_mesh_opens(tt_metal, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_MODEL", str(tmp_path / "elsewhere"))
    runner, ttnn = tree_runner(checkpoint(tmp_path), "models.tt_transformers.tt.generator_vllm:LlamaForCausalLM",
                               "N150")
    with pytest.raises(ValueError, match="HF_MODEL=.*elsewhere names another checkpoint than --model"):
        warm(runner)
    assert "ttnn.open_mesh_device" not in ttnn.recorder.names()


# The Galaxy generators: TtQwenModelArgs reads HF_MODEL only; TtModelArgs takes either, never both.
GALAXY_CLASSES = [
    pytest.param(GALAXY_ENV, "Llama-3.3-70B-Instruct", "LlamaForCausalLM", "TtModelArgs", id="llama3_70b_galaxy"),
    pytest.param(QWEN_GALAXY_ENV, "Qwen3-32B", "Qwen3ForCausalLM", "TtQwenModelArgs", id="qwen3_32b_galaxy"),
]


@pytest.mark.parametrize("env, name, arch, args_cls", GALAXY_CLASSES)
def test_the_galaxy_generators_read_hf_model(tt_metal, no_hf_model, tmp_path, env, name, arch, args_cls):
    model_dir = checkpoint(tmp_path, name, arch)
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(model_dir)), {**env, "MESH_DEVICE": "TG"},
                       serving=Serving(data_parallel_size=4, max_num_seqs=8), probe=lambda: chips(32, "GALAXY"))
    assert not plan.fatal, plan.fatal
    assert plan.environment.to_set == {"HF_MODEL": str(model_dir)}, plan.problems
    assert plan.entry.target_name.startswith(GALAXY + ":")
    [(var, variant)] = env.items()
    runner, ttnn = tree_runner(model_dir, plan.entry.target_name, "TG", env=env, variant=variant)
    warm(runner, num_lanes=4, max_num_seqs=8)
    [built] = ttnn.recorder.only("model.galaxy_model_args")  # one 32-device submesh, every row
    assert built == {"args_cls": args_cls, "ckpt_dir": str(model_dir), "num_devices": 32, "max_batch_size": 32}


def test_an_inherited_llama_dir_is_dropped_for_a_class_that_reads_hf_model(tt_metal, monkeypatch, tmp_path,
                                                                           caplog):
    # HF_MODEL already names --model and a LLAMA_DIR is inherited: TtModelArgs would assert
    # "Only one of LLAMA_DIR or HF_MODEL should be set".
    model_dir = checkpoint(tmp_path, "Llama-3.3-70B-Instruct")
    monkeypatch.setenv("HF_MODEL", str(model_dir))
    monkeypatch.setenv("LLAMA_DIR", str(tmp_path / "meta-llama-3.3"))
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(model_dir)),
                       {**os.environ, **GALAXY_ENV, "MESH_DEVICE": "TG"},
                       serving=Serving(data_parallel_size=4, max_num_seqs=8), probe=lambda: chips(32, "GALAXY"))
    assert not plan.fatal, plan.fatal
    assert plan.environment.to_set == {"LLAMA_DIR": None}
    assert any(f"LLAMA_DIR={tmp_path / 'meta-llama-3.3'} unset for the model" in note
               for note in plan.environment.notes), plan.environment.notes
    runner, ttnn = tree_runner(model_dir, f"{GALAXY}:LlamaForCausalLM", "TG", variant="llama3_70b_galaxy",
                               env={**os.environ, **GALAXY_ENV})
    with caplog.at_level(logging.INFO, logger="ttserve.worker.backends.ttnn.tt_models"):
        warm(runner, num_lanes=4, max_num_seqs=8)
    assert "LLAMA_DIR" not in os.environ and os.environ["HF_MODEL"] == str(model_dir)
    assert "LLAMA_DIR=" in caplog.text and "removed from the environment the model reads" in caplog.text
    [built] = ttnn.recorder.only("model.galaxy_model_args")
    assert built["ckpt_dir"] == str(model_dir)


# ---- lanes: folded by the plugin's rule, and the Galaxy divisibility assert --------------------

@pytest.mark.parametrize("cls_path, env, variant, folded", [
    ("models.tt_transformers.tt.generator_vllm:LlamaForCausalLM", {}, "tt_transformers", False),
    ("models.demos.llama3_70b_galaxy.tt.generator_vllm:LlamaForCausalLM", GALAXY_ENV, "llama3_70b_galaxy", True),
    ("models.tt_transformers.tt.generator_vllm:GptOssForCausalLM", {}, None, True),
])
def test_the_worker_reports_lanes_in_process_as_the_plugin_folds_them(tt_metal, tmp_path, cls_path, env, variant,
                                                                      folded):
    runner, _ = tree_runner(checkpoint(tmp_path), cls_path, "TG", env=env, variant=variant)
    assert DeviceService(runner, "ttnn", "mesh TG").description().lanes_in_process is folded


@pytest.mark.parametrize("lanes", [3, 8, 12])
@pytest.mark.parametrize("cls_name, env, variant", [("LlamaForCausalLM", GALAXY_ENV, "llama3_70b_galaxy"),
                                                    ("QwenForCausalLM", QWEN_GALAXY_ENV, "qwen3_32b_galaxy")])
def test_a_galaxy_lane_count_other_than_the_mesh_columns_is_refused_before_weights_load(
        tt_metal, no_hf_model, tmp_path, lanes, cls_name, env, variant):
    # 3 fails the dp_attention_factor assert, 12 create_submeshes' split (3 groups of 32 devices),
    # 8 the model args (two 16-device submeshes): on a TG only 4 lanes load.
    runner, ttnn = tree_runner(checkpoint(tmp_path), f"{GALAXY}:{cls_name}", "TG", env=env, variant=variant)
    with pytest.raises(ValueError, match="so the lane count must be 4: use --data-parallel-size 4$"):
        warm(runner, num_lanes=lanes, max_num_seqs=8)
    assert not ttnn.recorder.only("model.galaxy_model_args")
    assert not ttnn.recorder.only("model.initialize_vllm_model")


@pytest.mark.parametrize("lanes, error, message", [
    (3, AssertionError, r"Total DP \(3\) must be divisible by dp_attention_factor \(4\)"),
    (8, KeyError, "16"),  # two 16-device submeshes: not in the model args' device-name table
    (12, AssertionError, "Unsupported device split: 32 devices, 3 groups"),
])
def test_the_galaxy_generator_fake_loads_only_the_whole_8x4_mesh(tt_metal, monkeypatch, lanes, error, message):
    """The fake mirrors why ttserve refuses those counts: the real generator fails at load."""
    from fakes.fake_ttnn import FakeMesh
    from models.demos.llama3_70b_galaxy.tt.generator_vllm import LlamaForCausalLM, QwenForCausalLM
    from models.tt_transformers.tt.generator import TTNN
    monkeypatch.setenv("HF_MODEL", "/weights/Qwen3-32B")
    monkeypatch.delenv("LLAMA_DIR", raising=False)
    for cls in (LlamaForCausalLM, QwenForCausalLM):
        mesh = FakeMesh(TTNN.recorder, "mesh", 32, shape=(8, 4))
        with pytest.raises(error, match=message):
            cls.initialize_vllm_model(None, mesh, 8 * lanes, 4096, tt_data_parallel=lanes)
        assert cls.initialize_vllm_model(None, mesh, 32, 4096, tt_data_parallel=4) is not None
    monkeypatch.setenv("LLAMA_DIR", "/weights/meta")
    with pytest.raises(AssertionError, match="Only one of LLAMA_DIR or HF_MODEL should be set"):
        LlamaForCausalLM.initialize_vllm_model(None, FakeMesh(TTNN.recorder, "mesh", 32, shape=(8, 4)), 32, 4096,
                                               tt_data_parallel=4)
    monkeypatch.delenv("HF_MODEL")
    with pytest.raises(AssertionError, match="Please set HF_MODEL to a HuggingFace name e.g. Qwen/Qwen3-32B"):
        QwenForCausalLM.initialize_vllm_model(None, FakeMesh(TTNN.recorder, "mesh", 32, shape=(8, 4)), 32, 4096,
                                              tt_data_parallel=4)


def test_a_galaxy_generator_off_a_32_device_mesh_is_refused():
    from ttserve.worker.backends.ttnn.tt_models import ModelFamily, data_parallel_problem
    family = ModelFamily.of(f"{GALAXY}:QwenForCausalLM", "qwen3_32b_galaxy")
    problem = data_parallel_problem(family, 8, 8, resolve_mesh("T3K", 8))
    assert "builds its model on 32 devices only" in problem and "MESH_DEVICE=TG" in problem
    assert data_parallel_problem(family, 8, 8, resolve_mesh("(4,8)", 32)) is None  # 8 columns: 8 lanes
    assert "must be 8" in data_parallel_problem(family, 4, 8, resolve_mesh("(4,8)", 32))


def test_a_galaxy_gets_its_lane_count_as_tt_data_parallel_and_every_row(tt_metal, no_hf_model, tmp_path):
    runner, ttnn = tree_runner(checkpoint(tmp_path), f"{GALAXY}:LlamaForCausalLM",
                               "TG", env=GALAXY_ENV, variant="llama3_70b_galaxy")
    warm(runner, num_lanes=4, max_num_seqs=8)
    [init] = ttnn.recorder.only("model.initialize_vllm_model")
    assert (init["tt_data_parallel"], init["max_batch_size"]) == (4, 32)


# ---- the KV budget: get_max_tokens_all_users plus headroom --------------------------------------

# Llama 3.1 8B on N150 at its own 32768 limit (the class refuses more there, see below).
@pytest.mark.parametrize("name, max_model_len, tokens", [("Llama-3.1-8B-Instruct", 32_768, 32_768),
                                                         ("Llama-3.2-1B", 131_072, 131_072)])
def test_the_kv_cache_is_sized_by_the_model_not_a_fixed_131072(tt_metal, no_hf_model, tmp_path, name, max_model_len,
                                                               tokens):
    runner, ttnn = tree_runner(checkpoint(tmp_path, name), "models.tt_transformers.tt.generator_vllm:LlamaForCausalLM",
                               "N150")
    ttnn.recorder.calls.clear()
    warm(runner, max_num_seqs=2, max_model_len=max_model_len)
    # The model's budget is what the device holds; block 0 of it takes the padding (NULL).
    assert runner.layout.num_blocks_per_lane == (tokens + 64 * 2) // 64 - NULL
    assert ttnn.recorder.only("model.allocate_kv_cache")[0]["kv_cache_shape"][0] == (tokens + 64 * 2) // 64


def test_the_check_states_the_kv_budget_and_where_it_comes_from(tt_metal, no_hf_model, tmp_path):
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(checkpoint(tmp_path))),
                       {"MESH_DEVICE": "N150"}, serving=Serving(max_num_seqs=32, max_model_len=32768),
                       need_hardware=False, probe=lambda: ChipProbe(False, "no Tenstorrent chips detected on this host"))
    assert not plan.fatal, plan.fatal
    assert any("34816 tokens per lane = 32768 (LlamaForCausalLM.get_max_tokens_all_users" in line
               for line in plan.lines), plan.lines
    assert "plan not verified against hardware: no Tenstorrent chips detected on this host" in plan.warnings


# ---- Llama 3.1 8B / 3.2 11B on one Wormhole device: at most 32768 tokens ---------------------------

LLAMA = "models.tt_transformers.tt.generator_vllm:LlamaForCausalLM"


def test_the_llama_fake_refuses_over_32768_on_one_wormhole_device_as_tt_metal_does(tt_metal, monkeypatch):
    from types import SimpleNamespace

    from fakes.fake_ttnn import FakeMesh
    from models.tt_transformers.tt.generator import TTNN
    from models.tt_transformers.tt.generator_vllm import LlamaForCausalLM
    monkeypatch.setenv("HF_MODEL", "/weights/Llama-3.1-8B-Instruct")
    for name in ("/weights/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.2-11B-Vision-Instruct"):
        with pytest.raises(ValueError, match="do not support max_model_len greater than 32768 on N150"):
            LlamaForCausalLM.initialize_vllm_model(SimpleNamespace(_name_or_path=name),
                                                   FakeMesh(TTNN.recorder, "mesh", 1), 32, 32769)
        assert LlamaForCausalLM.initialize_vllm_model(SimpleNamespace(_name_or_path=name),
                                                      FakeMesh(TTNN.recorder, "mesh", 1), 32, 32768)
        assert LlamaForCausalLM.initialize_vllm_model(SimpleNamespace(_name_or_path=name),  # N300: the whole mesh
                                                      FakeMesh(TTNN.recorder, "mesh", 2), 32, 131072)
    assert LlamaForCausalLM.initialize_vllm_model(SimpleNamespace(_name_or_path="/weights/Llama-3.2-1B"),
                                                  FakeMesh(TTNN.recorder, "mesh", 1), 32, 131072)


@pytest.mark.parametrize("name", ["Llama-3.1-8B-Instruct", "Llama-3.2-11B-Vision-Instruct"])
def test_llama_8b_and_11b_over_32768_on_n150_are_refused_in_the_plan(tt_metal, no_hf_model, tmp_path, name):
    folder = checkpoint(tmp_path, name)  # max_position_embeddings 131072: the control plane's default
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(folder)), {"MESH_DEVICE": "N150"},
                       serving=Serving(max_num_seqs=32), probe=lambda: chips())
    [problem] = [p for p in plan.fatal if "max_model_len 131072" in p]
    assert "on one Wormhole device (MESH_DEVICE=N150" in problem and "--max-model-len 32768" in problem
    assert "bigger mesh" in problem
    for mesh, serving in (("N150", Serving(max_num_seqs=32, max_model_len=32768)),
                          ("N300", Serving(max_num_seqs=32)), ("P150", Serving(max_num_seqs=32))):
        plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(folder)), {"MESH_DEVICE": mesh},
                           serving=serving, need_hardware=False, probe=lambda: ChipProbe(False, "no chips"))
        assert not any("max_model_len" in p for p in plan.fatal), (mesh, plan.fatal)


def test_llama_8b_over_32768_on_n150_is_refused_before_the_mesh_opens(tt_metal, no_hf_model, tmp_path):
    runner, ttnn = tree_runner(checkpoint(tmp_path), LLAMA, "N150")
    with pytest.raises(ValueError, match="pass --max-model-len 32768 .*or serve on a bigger mesh"):
        warm(runner, max_model_len=65536)
    assert "ttnn.open_mesh_device" not in ttnn.recorder.names()
    assert not ttnn.recorder.only("model.initialize_vllm_model")


# ---- prefill rows carry the real tokens: the generator floors resume offsets -------------------

PROMPT = list(range(10, 50))  # 40 tokens


def fake_runner(model_dir: Path, monkeypatch, block_size=32, decode_contract=0, **tt) -> tuple[ModelRunner, FakeTtnn]:
    fake_tt_generator.install(monkeypatch)
    ttnn = FakeTtnn()
    runner = ModelRunner(model_dir, make_model_class(ttnn, decode_contract=decode_contract), "LlamaForCausalLM",
                         TtnnBackend(resolve_mesh("N300", 2), tt, ttnn=ttnn), torch.bfloat16, block_size=block_size,
                         kv_cache_bytes=0, options=DeviceOptions(tt, backend_traces=True, kv_tokens_per_lane=4096))
    warm(runner, max_num_seqs=4, max_model_len=256)
    return runner, ttnn


def greedy(rid: str, row: int) -> NewRequest:
    return NewRequest(rid, 0, row, 0.0, 1.0, 0, None)


def test_a_prefix_hit_that_the_generator_floors_rewrites_the_shared_block_with_the_real_tokens(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch)
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                             prefill=[PrefillChunk("a", PROMPT, 0, [3, 4], True)]))
    # b shares a's first block (32 tokens): its first chunk starts at 32, which the generator
    # floors to lcm(32, 64) = 64 -> 0 and recomputes, writing block 3 again.
    runner.execute(StepBatch(2, "prefill", new_requests=[greedy("b", 1)], prefill=[
        PrefillChunk("b", [7] * 8, 32, [3, 9], True, cached_token_ids=PROMPT[:32])]))
    model = runner.model
    assert ttnn.recorder.only("model.prefill_recomputed_from")[-1]["floors"] == [0]
    assert [model.kv[(3 + NULL, i)] for i in range(32)] == PROMPT[:32]  # a's KV intact
    assert [model.kv[(9 + NULL, i)] for i in range(8)] == [7] * 8


def test_chunked_prefill_rows_hold_the_earlier_chunks(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch)
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                             prefill=[PrefillChunk("a", PROMPT[:32], 0, [3], False)]))
    runner.execute(StepBatch(2, "prefill", prefill=[PrefillChunk("a", PROMPT[32:], 32, [4], True)]))
    [tokens] = ttnn.recorder.only("model.prefill_forward")[-1]["tokens"].tolist()
    assert tokens == PROMPT
    assert [runner.model.kv[(3 + NULL + i // 32, i % 32)] for i in range(40)] == PROMPT


def test_a_chunk_past_what_the_worker_holds_of_its_request_is_refused_alone(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch)
    result = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("b", 1), greedy("a", 0)], prefill=[
        PrefillChunk("b", [7] * 8, 32, [3, 9], True), PrefillChunk("a", PROMPT, 0, [4, 5], True)]))
    assert "starts at 32, but the worker holds 0 of the request's tokens" in result.refused["b"]
    assert set(result.tokens) == {"a"}  # the rest of the step ran
    [call] = ttnn.recorder.only("model.prefill_forward")
    assert call["empty_slots"] == [0]


def test_the_control_plane_sends_the_cached_prefix_with_a_hit_requests_first_chunk():
    from ttserve.control.blocks import BlockPool
    from ttserve.control.phase import PhasePolicy
    from ttserve.control.request import Request, SamplingParams
    from ttserve.control.scheduler import Scheduler, SchedulerConfig
    from ttserve.control.wire import step_batch_to_pb

    from ttserve.control.lanes import LaneGroup
    s = LaneGroup([Scheduler(SchedulerConfig(4, 8, 64), BlockPool(32, 4, enable_caching=True))], PhasePolicy(4))
    prompt = list(range(10, 22))  # three blocks of 4

    def step() -> object:
        plan = s.schedule()
        sampled = {w.request.request_id: 7 for w in plan.prefill if w.sample} | {
            w.request.request_id: 7 for w in plan.decode}
        s.update(plan, sampled, {})
        return step_batch_to_pb(1, plan.kind, plan.lanes, 4)

    s.lanes[0].add(Request("a", prompt, SamplingParams(max_tokens=8, eos_token_ids=frozenset({2}))))
    first = step()
    assert [list(c.cached_token_ids) for c in first.prefill] == [[]]  # a cold request: nothing cached
    s.lanes[0].add(Request("b", prompt[:8] + [99] * 12, SamplingParams(max_tokens=2, eos_token_ids=frozenset({2}))))
    chunks = [c for c in step().prefill if c.request_id == "b"]
    assert chunks[0].start_pos == 8 and list(chunks[0].cached_token_ids) == prompt[:8]
    later = [c for c in step().prefill if c.request_id == "b"]
    assert later and later[0].start_pos > 8 and not later[0].cached_token_ids  # the worker holds it now


# ---- device sampling: top_k == 1 means top_p 0; the sampler keeps 32 candidates ------------------

def sampled(rid: str, row: int, temperature: float, top_k: int, top_p: float = 0.9) -> NewRequest:
    return NewRequest(rid, 0, row, temperature, top_p, top_k, 7)


def test_a_top_k_1_row_goes_to_the_device_with_top_p_0(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch, sample_on_device_mode="all")
    result = runner.execute(StepBatch(1, "prefill", new_requests=[sampled("a", 0, 0.7, 1)],
                                      prefill=[PrefillChunk("a", PROMPT, 0, [3, 4], True)]))
    assert result.sampled_on_device
    params = ttnn.recorder.only("model.prefill_forward")[-1]["sampling_params"]
    assert (params.top_k, params.top_p) == ([1], [0.0])


@pytest.mark.parametrize("top_k", [0, 33, 50])
def test_a_row_needing_more_than_32_candidates_is_sampled_on_the_host(tmp_path, monkeypatch, top_k):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch, sample_on_device_mode="all")
    batch = StepBatch(1, "prefill", new_requests=[sampled("a", 0, 0.7, top_k), sampled("b", 1, 0.7, 20)],
                      prefill=[PrefillChunk("a", PROMPT, 0, [3, 4], True), PrefillChunk("b", PROMPT, 0, [5, 6], True)])
    result = runner.execute(batch)
    assert not result.sampled_on_device and set(result.tokens) == {"a", "b"}
    assert not ttnn.recorder.only("model.clamped_top_k")
    decode = runner.execute(StepBatch(2, "decode", decode=[DecodeItem("a", result.tokens["a"], 40, []),
                                                           DecodeItem("b", result.tokens["b"], 40, [])]))
    assert not decode.sampled_on_device and not ttnn.recorder.only("model.clamped_top_k")


def test_rows_within_the_device_top_k_stay_on_the_device(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch, sample_on_device_mode="all")
    result = runner.execute(StepBatch(1, "prefill", new_requests=[sampled("a", 0, 0.7, 32), sampled("b", 1, 0.0, 0)],
                                      prefill=[PrefillChunk("a", PROMPT, 0, [3, 4], True),
                                               PrefillChunk("b", PROMPT, 0, [5, 6], True)]))
    assert result.sampled_on_device


# ---- the decode input-update contract -------------------------------------------------------------

def test_an_input_update_contract_adapter_gets_its_commands_never_reset_batch(tmp_path, monkeypatch):
    runner, ttnn = fake_runner(checkpoint(tmp_path), monkeypatch, decode_contract=1, sample_on_device_mode="all")
    first = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                                     prefill=[PrefillChunk("a", PROMPT[:31], 0, [3], True)]))
    token, step = first.tokens["a"], 2
    for position, blocks in ((31, []), (32, [4]), (33, [])):
        out = runner.execute(StepBatch(step, "decode", decode=[DecodeItem("a", token, position, blocks)]))
        token, step = out.tokens["a"], step + 1
    commands = ttnn.recorder.only("model.decode_commands")
    assert [c["reload_inputs"] for c in commands] == [True, False, False]
    assert [c["reload_page_table"] for c in commands] == [False, True, False]  # the block appended at 32
    assert not ttnn.recorder.only("model.stale_page_table")


# ---- the Galaxy generator: its prefill alignment, padding and the decode contract ------------------
# tests/fakes/tt_metal/models/demos/llama3_70b_galaxy/tt/generator.py mirrors the real Generator.

def galaxy_runner(tmp_path: Path, **tt) -> tuple[ModelRunner, FakeTtnn]:
    runner, ttnn = tree_runner(checkpoint(tmp_path, "Llama-3.3-70B-Instruct"), f"{GALAXY}:LlamaForCausalLM", "TG",
                               env=GALAXY_ENV, variant="llama3_70b_galaxy", **tt)
    warm(runner, num_lanes=4, max_num_seqs=8)
    return runner, ttnn


def test_the_galaxy_generator_fake_speaks_the_decode_input_update_contract(tt_metal):
    """As tt-metal's host test pins the real class (test_the_base_generators_advertise_the_contract,
    test_the_legacy_reset_batch_signal_is_rejected)."""
    import inspect

    from fakes.fake_ttnn import FakeMesh
    from models.demos.llama3_70b_galaxy.tt.generator import Generator
    from models.tt_transformers.tt.generator import TTNN
    assert int(Generator.decode_input_update_contract) >= 1
    params = inspect.signature(Generator.decode_forward).parameters
    for command, safe in {"reload_inputs": True, "reload_page_table": False, "reload_sampling_params": False,
                          "reset_sampling_state": False}.items():
        assert params[command].kind is inspect.Parameter.KEYWORD_ONLY and params[command].default is safe
    model = Generator(FakeMesh(TTNN.recorder, "mesh", 32, shape=(8, 4)), 32)
    with pytest.raises(ValueError, match="predates it"):
        model.decode_forward(torch.zeros((1, 1), dtype=torch.int64), torch.zeros((1,), dtype=torch.int64),
                             reset_batch=True)


def test_a_galaxy_decode_gets_the_contracts_commands_and_continues_on_the_device(tt_metal, no_hf_model, tmp_path):
    from fakes.fake_tt_model import next_token
    runner, ttnn = galaxy_runner(tmp_path, sample_on_device_mode="all")
    prompt = [(5 * i + 3) % 60 + 3 for i in range(63)]  # the first decode fills block 3, the second needs 4
    token = runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                                     prefill=[PrefillChunk("a", prompt, 0, [3], True)])).tokens["a"]
    tokens = [token]
    for step, (position, blocks) in enumerate(((63, []), (64, [4]), (65, [])), start=2):
        out = runner.execute(StepBatch(step, "decode", decode=[DecodeItem("a", token, position, blocks)]))
        token = out.tokens["a"]
        tokens.append(token)
    assert tokens == [next_token(prompt[-1], 62, 64)] + [next_token(t, p, 64) for t, p in zip(tokens, (63, 64, 65))]
    commands = ttnn.recorder.only("model.decode_commands")
    assert [c["reload_inputs"] for c in commands] == [True, False, False]
    assert [c["reload_page_table"] for c in commands] == [False, True, False]  # the block appended at 64
    assert [c["reload_sampling_params"] for c in commands] == [True, False, False]
    assert not ttnn.recorder.only("model.stale_page_table") and not ttnn.recorder.only("model.stale_sampling_params")
    # ttserve warms the prefill itself: the first prefill runs no lazy prefill_warmup.
    assert not any(w["lazy"] for w in ttnn.recorder.only("model.prefill_warmup"))


@pytest.mark.parametrize("prompt_len, hit_blocks, recomputed_from", [
    (140, 1, 0),       # 64 floors to SDPA_CHUNK_ALIGN: 0
    (300, 2, 0),       # 128 kept by the alignment, dropped by _should_skip_prefix_caching (1024 vs 1024)
    (300, 4, 256),     # 44 new tokens: 128 against 1024
    (1100, 2, 128),    # 1024 against 2048, total <= 16384
    (1100, 16, 1024),
])
def test_a_galaxy_prefix_hit_is_floored_to_128_or_skipped_and_recomputed_from_the_real_tokens(
        tt_metal, no_hf_model, tmp_path, prompt_len, hit_blocks, recomputed_from):
    runner, ttnn = galaxy_runner(tmp_path)
    prompt = [(7 * i + 3) % 60 + 3 for i in range(prompt_len)]
    blocks_a = list(range(100, 100 + -(-prompt_len // 64)))
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                             prefill=[PrefillChunk("a", prompt, 0, blocks_a, True)]))
    start = hit_blocks * 64
    new_blocks = list(range(200, 200 + len(blocks_a) - hit_blocks))
    runner.execute(StepBatch(2, "prefill", new_requests=[greedy("b", 1)], prefill=[
        PrefillChunk("b", prompt[start:], start, blocks_a[:hit_blocks] + new_blocks, True,
                     cached_token_ids=prompt[:start])]))
    assert ttnn.recorder.only("model.prefill_recomputed_from")[-1]["floors"] == [recomputed_from]
    kv = runner.model.kv
    blocks_b = blocks_a[:hit_blocks] + new_blocks
    assert [kv[(blocks_a[i // 64] + NULL, i % 64)] for i in range(prompt_len)] == prompt  # a's KV intact
    assert [kv[(blocks_b[i // 64] + NULL, i % 64)] for i in range(prompt_len)] == prompt


def test_a_galaxy_prefills_padding_lands_in_no_other_requests_block(tt_metal, no_hf_model, tmp_path):
    """The Galaxy generator pads a prefill to 128 and writes the padding's KV through the row's
    zero-padded page table, into device block 0: the worker keeps that block out of every table
    (TtnnBackend.null_block), as vLLM keeps block 0 as its null block, so the control plane's
    first block (a's) is not overwritten."""
    from ttserve.control.blocks import BlockPool
    runner, ttnn = galaxy_runner(tmp_path)
    pool = BlockPool(64, 64)
    blocks_a, blocks_b = pool.allocate(1), pool.allocate(1)
    runner.execute(StepBatch(1, "prefill", new_requests=[greedy("a", 0)],
                             prefill=[PrefillChunk("a", PROMPT, 0, blocks_a, True)]))
    # b's 40 tokens are padded to 128: positions 64..127 go through its row's second entry.
    runner.execute(StepBatch(2, "prefill", new_requests=[greedy("b", 1)],
                             prefill=[PrefillChunk("b", PROMPT, 0, blocks_b, True)]))
    assert ttnn.recorder.only("model.prefill_padding_blocks")[-1]["blocks"] not in ([], blocks_b)
    assert [runner.model.kv[(blocks_a[0] + NULL, i)] for i in range(40)] == PROMPT


# ---- fabric from the cluster type ------------------------------------------------------------------

@pytest.mark.parametrize("mesh, cluster, fabric", [
    ("T3K", "GALAXY", "FABRIC_1D_RING"), ("T3K", "T3K", "FABRIC_1D"), ("P150x4", "BLACKHOLE_GALAXY", "FABRIC_2D_TORUS_XY"),
    ("TG", "GALAXY", "FABRIC_1D_RING"), ("N150", "GALAXY", None),
    # The 4U Galaxy (ClusterType.TG) is not the plugin's GALAXY: FABRIC_1D, as any other cluster.
    ("TG", "TG", "FABRIC_1D"), ("T3K", "TG", "FABRIC_1D")])
def test_the_default_fabric_follows_the_hosts_cluster_type(mesh, cluster, fabric):
    assert fabric_for(resolve_mesh(mesh, 32), None, cluster) == fabric


def test_a_tg_plan_on_a_blackhole_galaxy_takes_its_arch_and_its_torus(tt_metal, no_hf_model, tmp_path):
    # The plugin's README runs Qwen3-32B on a Blackhole Galaxy with MESH_DEVICE=TG.
    probe = ChipProbe(True, "32 blackhole chip(s), cluster BLACKHOLE_GALAXY", 32, "blackhole", True,
                      "BLACKHOLE_GALAXY")
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(checkpoint(tmp_path, "Qwen3-32B",
                                                                                  "Qwen3ForCausalLM"))),
                       {**QWEN_GALAXY_ENV, "MESH_DEVICE": "TG"}, serving=Serving(data_parallel_size=4, max_num_seqs=8),
                       probe=lambda: probe)
    assert not plan.fatal, plan.fatal
    assert (plan.mesh.arch, plan.mesh.shape, plan.fabric) == ("blackhole", (8, 4), "FABRIC_2D_TORUS_XY")


def test_a_t3k_submesh_on_a_galaxy_opens_with_the_ring(tmp_path):
    ttnn = FakeTtnn()
    TtnnBackend(resolve_mesh("T3K", 32), {}, ttnn=ttnn, cluster="GALAXY").open()
    [fabric] = ttnn.recorder.only("ttnn.set_fabric_config")
    assert fabric["config"] is FabricConfig.FABRIC_1D_RING


# ---- the smaller rows ------------------------------------------------------------------------------

def test_register_test_models_adds_tt_metals_dummy_models():
    assert "TTDummyNoOpModel" not in build_registry("ttnn", {}).names()
    assert {"TTDummyNoOpModel", "TTDummyT3000MultiProcessModel", "TTDummyDualGlxModel"} <= set(
        build_registry("ttnn", {}, test_models=True).names())


def test_the_sim_refuses_a_mesh_device_that_names_no_mesh(monkeypatch, smollm2):
    monkeypatch.setenv("MESH_DEVICE", "Q999")
    with pytest.raises(worker_config.ConfigRefused, match="MESH_DEVICE='Q999' is not a mesh"):
        worker_config.build_service(worker_args("--backend", "sim", "--model", str(smollm2)))


def test_galaxy_generators_take_no_custom_optimizations(tt_metal, tmp_path):
    plan = plan_worker(worker_args("--backend", "ttnn", "--model", str(checkpoint(tmp_path)),
                                   "--additional-config.tt.optimizations", "accuracy"),
                       {**GALAXY_ENV, "MESH_DEVICE": "TG"}, probe=lambda: chips(32, "GALAXY"))
    assert any("takes no custom optimizations" in p for p in plan.fatal), plan.problems


# ---- ttserve check, as an operator runs it -----------------------------------------------------------

CHECK_UNSET = ("HF_MODEL", "LLAMA_DIR", "MESH_DEVICE")  # the host's, which would change the plan


def run_check(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`python -m ttserve.cli check ARGV` in a process of its own, as an operator runs it."""
    environ = {k: v for k, v in os.environ.items() if k not in CHECK_UNSET}
    environ.update(env, PYTHONPATH=os.pathsep.join([str(TREE), str(TESTS)]))
    return subprocess.run([sys.executable, "-m", "ttserve.cli", "check", *argv], capture_output=True, text=True,
                          env=environ, timeout=120)


@pytest.fixture
def check_here(tt_metal, monkeypatch, capsys):
    """run_check's twin in this process: the CLI's main(["check", ...]) under the same environment
    (the fake tt-metal tree importable, CHECK_UNSET unset, `env` set), its exit status and output as
    a CompletedProcess. A process of its own costs ~10 CPU-s of torch and vLLM imports, paid here
    once; test_check_passes_the_embedded_default_and_refuses_a_bad_control_flag keeps a real one."""
    from ttserve import cli

    vllm_log = logging.getLogger("vllm")
    level = vllm_log.level

    def run(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess:
        for var in CHECK_UNSET:
            monkeypatch.delenv(var, raising=False)
        for var, value in env.items():
            monkeypatch.setenv(var, value)
        capsys.readouterr()
        status = cli.main(["check", *argv])
        captured = capsys.readouterr()
        return subprocess.CompletedProcess(["ttserve", "check", *argv], status, captured.out, captured.err)

    yield run
    vllm_log.setLevel(level)  # the check quiets vLLM's import-time notes; other tests' logs keep them


@pytest.mark.parametrize("lanes", ["3", "8"])
def test_check_refuses_a_galaxy_lane_count_other_than_4(tmp_path, check_here, lanes):
    done = check_here("--backend", "ttnn", "--model", str(checkpoint(tmp_path)), "--data-parallel-size", lanes,
                      env={"MESH_DEVICE": "TG", **GALAXY_ENV})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "lane count must be 4: use --data-parallel-size 4" in done.stdout
    assert f"{GALAXY}:LlamaForCausalLM" in done.stdout


def test_check_prints_the_plan_of_a_good_configuration_and_passes_without_chips(tmp_path, check_here):
    done = check_here("--backend", "ttnn", "--model", str(checkpoint(tmp_path)),
                      "--additional-config.tt.sample_on_device_mode", "all", "--max-num-seqs", "32",
                      "--max-model-len", "32768", env={"MESH_DEVICE": "N150"})
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for expected in ("mesh:", "N150 1x1", "TTLlamaForCausalLM (tt_transformers)", "HF_MODEL=", "(set from --model)",
                     "34816 tokens per lane", "tt_data_parallel=1", "async decode: on", "sampling:     on device",
                     "warning: worker: plan not verified against hardware"):
        assert expected in out, (expected, out)


def test_check_fails_on_each_services_bad_flags(tmp_path, check_here):
    done = check_here("--backend", "ttnn", "--model", str(checkpoint(tmp_path)), "--max-num-seqs", "12",
                      "--additional-config.tt.rank_binding", "ranks.yaml", env={"MESH_DEVICE": "N150"})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "tt.rank_binding = 'ranks.yaml' configures the TT vLLM plugin's multi-rank launch" in done.stdout
    assert "--max-num-seqs 12: tt_transformers' ModelArgs supports batch sizes 1, 2, 4, 8, 16, 32" in done.stdout


# ---- KV cache shape and dtype; DeepSeek's data parallelism -----------------------------------------

def test_a_hybrid_attention_class_allocates_per_layer_in_the_checkpoints_dtype(tmp_path, monkeypatch):
    fake_tt_generator.install(monkeypatch)
    ttnn = FakeTtnn()

    class Hybrid(make_model_class(ttnn)):
        def allocate_kv_cache_per_layer(self, per_layer_specs):  # generator_vllm HybridAttentionForCausalLM
            ttnn.recorder.add("model.allocate_kv_cache_per_layer", specs=per_layer_specs)
            self.block_size = per_layer_specs[0][0][2]
            return [["kv"] for _ in per_layer_specs]

    model_dir = checkpoint(tmp_path)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "torch_dtype": "float16"}))
    runner = ModelRunner(model_dir, Hybrid, "LlamaForCausalLM", TtnnBackend(resolve_mesh("N300", 2), {}, ttnn=ttnn),
                         torch.bfloat16, block_size=32, kv_cache_bytes=0,
                         options=DeviceOptions({}, backend_traces=True, kv_tokens_per_lane=4096))
    warm(runner, max_num_seqs=4, max_model_len=256)
    [call] = ttnn.recorder.only("model.allocate_kv_cache_per_layer")
    assert call["specs"] == [((32 + NULL, 1, 32, 16), torch.float16, 0), ((32 + NULL, 1, 32, 16), torch.float16, 1)]
    assert not ttnn.recorder.only("model.allocate_kv_cache")


def test_deepseek_gets_the_mesh_device_count_as_tt_data_parallel():
    from ttserve.worker.backends.ttnn.tt_models import ModelFamily, data_parallel_problem, tt_data_parallel
    family = ModelFamily.of("models.demos.deepseek_v3.tt.generator_vllm:DeepseekV3ForCausalLM")
    tg = resolve_mesh("TG", 32)
    assert tt_data_parallel(family, 1, tg) == 32 and family.checkpoint_variable == "DEEPSEEK_V3_HF_MODEL"
    assert data_parallel_problem(family, 1, 32, tg) is None
    assert "rows must be a multiple of 32" in data_parallel_problem(family, 1, 16, tg)


def test_qwen3_vl_is_refused_a_second_lane():
    # Its generator holds one model and ignores empty_slots: a second lane's requests would
    # prefill into the first lane's KV cache.
    from ttserve.worker.backends.ttnn.tt_models import ModelFamily, data_parallel_problem
    family = ModelFamily.of("models.demos.qwen3_vl.tt.generator_vllm:Qwen3VLForConditionalGeneration")
    t3k = resolve_mesh("T3K", 8)
    assert data_parallel_problem(family, 1, 32, t3k) is None
    assert "--data-parallel-size 1" in data_parallel_problem(family, 2, 32, t3k)
    qwen25 = ModelFamily.of("models.demos.qwen25_vl.tt.generator_vllm:Qwen2_5_VLForConditionalGeneration")
    assert data_parallel_problem(qwen25, 2, 32, t3k) is None


# ---- --max-model-len -1: one request fits a lane's whole KV cache ------------------------------------

def test_max_model_len_minus_1_fits_a_lane_and_below_is_refused(tmp_path):
    from ttserve.control import config as control_config
    from ttserve.control.serving_plan import plan_serving, plan_warmup
    from ttserve.control.wire import WorkerDescription

    parser = argparse.ArgumentParser()
    control_config.add_arguments(parser)
    with pytest.raises(control_config.ConfigError, match="-1 \\(fit to the KV cache\\), got -2"):
        control_config.engine_config(parser.parse_args(["--max-model-len", "-2"]))
    described = WorkerDescription("w", "ttnn", "mesh", str(tmp_path), "LlamaForCausalLM", 64, 131072, [2],
                                  True, True, block_size=64)
    config = control_config.engine_config(parser.parse_args(["--max-model-len", "-1"]))
    warm = WorkerDescription("w", "ttnn", "mesh", str(tmp_path), "LlamaForCausalLM", 64, 131072, [2],
                             True, True, num_blocks_per_lane=34816 // 64, block_size=64)
    assert plan_serving(config, warm, plan_warmup(config, described, 1), None).max_model_len == 34816


def test_a_generator_emitting_several_tokens_per_step_is_refused(tmp_path, monkeypatch):
    fake_tt_generator.install(monkeypatch)
    ttnn = FakeTtnn()

    class Speculative(make_model_class(ttnn)):
        model_capabilities = {"supports_prefix_caching": True, "output_tokens_per_step": 2}

    runner = ModelRunner(checkpoint(tmp_path), Speculative, "LlamaForCausalLM",
                         TtnnBackend(resolve_mesh("N300", 2), {}, ttnn=ttnn), torch.bfloat16, block_size=32,
                         kv_cache_bytes=0, options=DeviceOptions({}, backend_traces=True))
    with pytest.raises(ValueError, match="output_tokens_per_step = 2; ttserve's decode steps take one token"):
        warm(runner)


def test_check_passes_the_embedded_default_and_refuses_a_bad_control_flag(smollm2, check_here):
    done = run_check(env={})  # end to end: the entry point, a fresh process's imports, the exit status
    assert done.returncode == 0, done.stdout + done.stderr
    assert "backend:      torch" in done.stdout and "nothing found that would stop start-up" in done.stdout
    done = check_here("--max-num-seqs", "0", "--port", "50051", env={})
    assert done.returncode == 1
    assert "error: control plane: --max-num-seqs must be a positive per-lane count, got 0" in done.stdout
    assert "error: port 50051 is given to 2 services" in done.stdout


def test_a_worker_converts_an_embedded_model_not_prepared_yet_then_plans_with_it(monkeypatch, tmp_path):
    """The plan leaves an unconverted embedded model's checks to start-up (`ttserve check` writes
    nothing); the worker's start-up converts it and plans again, rather than serve no folder."""
    monkeypatch.setenv("TTSERVE_CACHE_DIR", str(tmp_path))
    args = worker_args("--backend", "sim", "--model", "smollm2")
    assert plan_worker(args).model_path is None  # nothing converted yet
    service = worker_config.build_service(args)
    assert service.runner.model_path == tmp_path / "models" / "SmolLM2-135M-Instruct"
    assert plan_worker(args).model_path == service.runner.model_path
