"""Gateway start-up pieces on vLLM's own objects, without a control plane: the config's limits,
the stat loggers and the middleware of vLLM's app."""
from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from ttserve.v1 import engine_pb2

MODEL_INFO = engine_pb2.ModelInfo(max_model_len=2048, block_size=32, num_blocks=128)


def vllm_config_for(model: str, *flags: str):
    from ttserve.gateway.server import build_vllm_config, parse_vllm_args
    return build_vllm_config(parse_vllm_args(["--model", model, *flags]), MODEL_INFO)


@pytest.mark.parametrize("flag, expected", [("1024", 1024), ("4096", 2048)])
def test_max_model_len_is_the_smaller_of_the_users_and_the_control_planes(smollm2, flag, expected):
    config = vllm_config_for(str(smollm2), "--max-model-len", flag)
    assert config.model_config.max_model_len == expected


def test_vllm_records_no_prometheus_metrics_but_keeps_its_log_stats(smollm2):
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
    from vllm.v1.metrics.stats import IterationStats

    from ttserve.gateway.engine_client import GatewayLLM, GrpcEngineCoreClient

    config = vllm_config_for(str(smollm2))

    async def stat_loggers():
        llm = GatewayLLM(config, GrpcEngineCoreClient("127.0.0.1:1"))  # never reached
        try:
            stats = IterationStats()
            stats.num_generation_tokens = 5  # what one step of a request reports
            llm.logger_manager.record(scheduler_stats=None, iteration_stats=stats)
            return llm.logger_manager.stat_loggers
        finally:
            llm.shutdown()

    loggers = asyncio.run(stat_loggers())
    prometheus = [s for s in loggers if isinstance(s, PrometheusStatLogger)]
    assert prometheus and all(not vars(s) for s in prometheus)  # only the one that holds nothing
    assert any(isinstance(per_engine, LoggingStatLogger) for s in loggers
               for per_engine in getattr(s, "per_engine_stat_loggers", {}).values())
    assert not [m.name for m in REGISTRY.collect() if m.name.startswith("vllm:")]  # none recorded


def test_vllm_http_instrumentation_is_dropped_and_ours_is_outermost():
    from fastapi import FastAPI
    from prometheus_fastapi_instrumentator import Instrumentator

    from ttserve.gateway.body_limit import BodyLimitMiddleware
    from ttserve.gateway.errors import RefusalStatusMiddleware
    from ttserve.gateway.metrics import RequestDurationMiddleware
    from ttserve.gateway.server import install_middleware

    app = FastAPI()
    Instrumentator().instrument(app)  # as vLLM's build_app does
    install_middleware(app)
    assert [m.cls for m in app.user_middleware] == [BodyLimitMiddleware, RequestDurationMiddleware,
                                                    RefusalStatusMiddleware]


def gateway_args(*argv: str):
    import argparse
    from ttserve.gateway import config
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_a_vision_model_gets_vllms_multimodal_flags_and_a_text_model_none(tiny_vlm):
    from ttserve.gateway import vllm_compat
    from ttserve.gateway.server import NO_MEDIA_FETCHING, vllm_argv
    vision = engine_pb2.ModelInfo(max_model_len=2048, block_size=16, num_blocks=64, supports_images=True,
                                  dtype="float32")
    argv = vllm_argv(gateway_args(), str(tiny_vlm), vision)
    assert argv[argv.index("--mm-processor-cache-gb") + 1] == "0"  # every image carries its tensors
    assert argv[argv.index("--limit-mm-per-prompt") + 1] == '{"image": 8}'
    assert argv[argv.index("--allowed-media-domains") + 1] == NO_MEDIA_FETCHING  # no http fetching by default
    assert "--no-mm-device-do-normalize" in argv and argv[argv.index("--dtype") + 1] == "float32"
    allowed = vllm_argv(gateway_args("--allowed-media-domains", "images.example", "cdn.example",
                                     "--limit-images-per-prompt", "2"), str(tiny_vlm), vision)
    assert allowed[allowed.index("--allowed-media-domains") + 1:][:2] == ["images.example", "cdn.example"]
    assert allowed[allowed.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'
    assert not {"--mm-processor-cache-gb", "--limit-mm-per-prompt"} & set(vllm_argv(gateway_args(), "m", MODEL_INFO))
    # The flags build vLLM's config for the tiny checkpoint: a multimodal model with mRoPE.
    vllm_compat.prepare()
    from ttserve.gateway import vllm_patches
    vllm_patches.run_model_inspection_in_process()
    vllm_patches.register_images_only_vision_models()
    from ttserve.gateway.server import build_vllm_config, parse_vllm_args
    config = build_vllm_config(parse_vllm_args(argv), vision)
    assert config.model_config.is_multimodal_model and config.model_config.uses_mrope
    assert config.model_config.get_multimodal_config().mm_processor_cache_gb == 0


def test_the_gateway_imports_vllm_without_triton():
    """A gateway runs no kernel: vLLM's import must leave triton unloaded (71 MiB of RSS) and
    vLLM must see it as absent, not fail on it (vllm_compat.hide_kernel_compilers)."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "from ttserve.gateway import vllm_compat\n"
             "vllm_compat.prepare()\n"
             "import vllm.engine.arg_utils, vllm.entrypoints.launchers.app\n"
             "from vllm.triton_utils import HAS_TRITON\n"
             "print(HAS_TRITON, sorted(m for m in sys.modules if m.startswith('triton') and sys.modules[m]))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.split("\n")[-2] == "False []", out.stdout + out.stderr
