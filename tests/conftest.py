from __future__ import annotations

import os
from pathlib import Path

import pytest

# torch's OpenMP threads (libgomp) spin-wait between parallel regions unless told otherwise. On a
# machine with as many cores as one process has threads (CI: 2), a spinning thread holds the core
# that its partner, another process's thread, needs: transformers' generate in a test process ran
# 10x slower beside a busy service or a second xdist worker. Passive waiting changes no result, only
# how an idle thread waits; set before anything imports torch, and inherited by every service the
# tests start (their environment is this one's plus their own). A value already set is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# One intra-op thread per process (the test processes' torch, and every worker the tests start:
# worker/config.cpu_threads honours OMP_NUM_THREADS): the suite runs several test processes and their
# services at once on two cores, where a two-thread parallel region waits at its barrier for a
# thread that another process has preempted (a decode step measured 14 ms alone, up to 230 ms so).
# The suite passes at one thread and at the default count alike.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The prepared SmolLM2-135M-Instruct folder (converted once, then reused)."""
    from ttserve.worker.planning.model_prepare import prepare
    return prepare("smollm2")


@pytest.fixture(scope="session")
def hf_smollm2(smollm2):
    """transformers' SmolLM2 as the oracle, loaded once per session: (tokenizer, model) in float32
    with eager attention (plain softmax(QK^T)V, the textbook computation the reference model and
    the served outputs are compared with). Tests must not change the model's state."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    return tokenizer, model


@pytest.fixture(scope="session")
def tiny_vlm(smollm2, tmp_path_factory) -> Path:
    """A tiny random-weight Qwen2.5-VL checkpoint (worker/planning/tiny_vlm.py), built once per session
    with transformers (config, safetensors, tokenizer and PIL image processor)."""
    from ttserve.worker.planning.tiny_vlm import build
    folder = tmp_path_factory.mktemp("tiny-vlm") / "tiny-vlm-Qwen2.5-VL"
    build(folder, smollm2)
    return folder


@pytest.fixture(scope="session")
def tiny_gemma3(smollm2, tmp_path_factory) -> Path:
    """A tiny random-weight Gemma 3 text checkpoint (worker/planning/tiny_gemma3.py): local
    sliding-window and global layers, built once per session with transformers."""
    from ttserve.worker.planning.tiny_gemma3 import build
    folder = tmp_path_factory.mktemp("tiny-gemma3") / "tiny-gemma3"
    build(folder, smollm2)
    return folder


@pytest.fixture(scope="session")
def hf_tiny_gemma3(tiny_gemma3):
    """(tokenizer, transformers' model) for tiny_gemma3, the oracle: float32, eager attention."""
    import torch
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny_gemma3)
    model = transformers.Gemma3ForCausalLM.from_pretrained(
        tiny_gemma3, dtype=torch.float32, attn_implementation="eager").eval()
    return tokenizer, model


def assert_logits_close(ours, ref, rel_tol: float = 1e-4) -> None:
    """Logits within rel_tol of the reference's largest magnitude (the reference models' oracle check)."""
    scale = float(ref.abs().max())
    diff = float((ours.float() - ref.float()).abs().max())
    assert diff <= rel_tol * scale, f"max abs diff {diff:.3g} exceeds {rel_tol} x {scale:.3g}"


@pytest.fixture(scope="session")
def hf_tiny_vlm(tiny_vlm):
    """transformers' model and processor for tiny_vlm, the oracle: (processor, model) in float32
    with eager attention. The processor is the gateway's images-only Qwen2.5-VL processor (the
    PIL image processor), so both sides see the same pixels."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from ttserve.gateway.vision_compat import ImagesOnlyQwen2_5_VLProcessor

    processor = ImagesOnlyQwen2_5_VLProcessor.from_pretrained(tiny_vlm)
    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        tiny_vlm, dtype=torch.float32, attn_implementation="eager").eval()
    return processor, model


def sample_image(width: int, height: int, seed: int):
    """A deterministic RGB image with structure (gradients plus noise), as PNG-ready PIL."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1),
                     (x + y) * 127 // max(width + height - 2, 1)], axis=-1)
    noise = rng.integers(0, 64, size=(height, width, 3))
    return Image.fromarray(((base + noise) % 256).astype("uint8"), "RGB")


# The OpenAI client of a module's gateway: modules that define a `stack` fixture (a Stack with a
# gateway) get these two.
@pytest.fixture(scope="module")
def client(stack):
    import openai

    return openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model_name(client) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def single_torch_thread():
    """One intra-op torch thread in this test process for a module (restored after)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- pytest-xdist (`make test` and `make unit` run `-n 3`; pyproject.toml sets --dist loadfile) --
# A worker takes whole files: a module's stack (a module-scoped fixture) starts once, and a
# module's tests run in their order on one worker. The exception is the benchmarks' file: each
# of its tests runs one benchmark script in a process of its own and shares nothing, so each is
# a unit of work of its own and the long ones run beside each other instead of one after another.
SPLIT_FILES = ("tests/test_benchmarks.py",)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class Scheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.split("::", 1)[0] in SPLIT_FILES:
                return nodeid
            return super()._split_scope(nodeid)

    return Scheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the longest units of work first (pyproject.toml keeps this order with
    --no-loadscope-reorder), so that none of them starts last while the other worker has nothing
    left: the benchmarks, then the files that start services, then the rest. Whole files move,
    so a module's own order is kept; a serial run keeps the collection order."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    e2e_files = {item.path for item in items if item.get_closest_marker("e2e")}

    def rank(item) -> int:
        if item.nodeid.split("::", 1)[0] in SPLIT_FILES:
            return 0
        return 1 if item.path in e2e_files else 2

    items.sort(key=rank)  # stable: collection order within a rank
