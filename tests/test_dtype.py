"""The worker's --dtype rule (worker/backends/torch/dtype.py) and its thread count (worker/config.py)."""
from __future__ import annotations

import argparse

import pytest
import torch

from ttserve.worker import config
from ttserve.worker.backends.torch import dtype
from ttserve.worker.backends.torch.dtype import DTYPE_CHOICES, cpu_has_native_bf16, resolve_dtype

ZEN5 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
AMX = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n"
SKYLAKE = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512vl\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("text, native", [(ZEN5, True), (AMX, True), (GRAVITON3, True), (SKYLAKE, False)],
                         ids=["avx512_bf16", "amx_bf16", "arm-bf16", "avx512-without-bf16"])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, text, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(text)
    assert cpu_has_native_bf16(cpuinfo) is native


@pytest.mark.parametrize("native, expected", [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_on_a_cpu_is_bfloat16_exactly_when_the_cpu_has_native_bf16(monkeypatch, native, expected):
    monkeypatch.setattr(dtype, "cpu_has_native_bf16", lambda: native)
    got, why = resolve_dtype("auto", torch.device("cpu"))
    assert got == expected and why.startswith("auto")


def test_explicit_dtypes_are_taken_as_given_and_unknown_ones_refused():
    for name in ("bfloat16", "float16", "float32"):
        assert resolve_dtype(name, torch.device("cpu")) == (getattr(torch, name), "requested")
    with pytest.raises(ValueError, match="half"):
        resolve_dtype("half", torch.device("cpu"))


def test_worker_dtype_flag_takes_vllms_names_and_defaults_to_auto():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    assert parser.parse_args([]).dtype == "auto"
    assert set(DTYPE_CHOICES) == {"auto", "bfloat16", "float16", "float32"}
    for name in DTYPE_CHOICES:
        assert parser.parse_args(["--dtype", name]).dtype == name
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "fp8"])


def test_threads_default_to_the_cores_this_process_may_run_on(monkeypatch):
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert config.cpu_threads({}) == 1
    monkeypatch.setattr(config.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert config.cpu_threads({}) == 4
    # OMP_NUM_THREADS, as torch honours it, when it is a positive count; anything else is ignored.
    assert config.cpu_threads({"OMP_NUM_THREADS": "2"}) == 2
    for ignored in ("", "0", "four", "-1"):
        assert config.cpu_threads({"OMP_NUM_THREADS": ignored}) == 4
