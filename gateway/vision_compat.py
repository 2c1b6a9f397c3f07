"""Image processing for vision models without torchvision: the one contained compatibility step.

vLLM serves a vision model's images through the model's own multimodal processor, registered on
its model class (vllm/model_executor/models/qwen2_5_vl.py for Qwen2.5-VL). On these hosts two
things stand in the way, both from torchvision being absent (it cannot be installed beside
torch's CPU build, see vllm_compat.py):

- vLLM's `qwen2_vl` module (which `qwen2_5_vl` imports) imports `smart_resize` from transformers'
  `image_processing_qwen2_vl`, which imports torchvision at its top. transformers ships the same
  processor on PIL (`image_processing_pil_qwen2_vl`: same `smart_resize`, same outputs); the
  missing module is stood in by one that re-exports the PIL one.
- transformers' Qwen2.5-VL processor also builds a video processor, which needs torchvision.
  ttserve serves images only (as the TT plugin does: tt-metal's processing info allows no
  video), so the processor here has no video part: `ImagesOnlyQwen2_5_VLProcessor`.

The classes here are a subclass of vLLM's own Qwen2.5-VL class with the images-only processing
info, which gateway/vllm_patches.py (`register_images_only_vision_models`) puts in vLLM's model
registry under the checkpoint's architecture name (as tt-metal's generator_vllm.py registers
`TT_Qwen2_5_VLProcessingInfo`). Everything else - placeholder
expansion, hashing, limits, the renderer - is vLLM's. With a working torchvision none of this
would be needed; the outputs are the same (the PIL and torchvision processors are tested equal
upstream), and the oracle tests use this same processor.
"""
from __future__ import annotations

import importlib
import sys
import types

from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor

# Architectures whose vLLM module needs the stand-in, and the registry path of their class here.
VISION_ARCHITECTURES = {
    "Qwen2_5_VLForConditionalGeneration": "ttserve.gateway.vision_compat:Qwen2_5_VLForConditionalGeneration",
}
_TORCHVISION_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"


class ImagesOnlyQwen2_5_VLProcessor(Qwen2_5_VLProcessor):
    """transformers' Qwen2.5-VL processor with its image processor and tokenizer only: the
    sub-processors are read off __init__'s signature, so no video processor (torchvision) is
    loaded. Videos are refused by the limits (video: 0) before they would reach it."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs) -> None:
        super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:
            raise ValueError("videos are not supported: this server takes images only")
        return super().__call__(images=images, text=text, **kwargs)


def stand_in_torchvision_processor() -> None:
    """Make `image_processing_qwen2_vl` importable: the PIL module's names under its name."""
    try:
        importlib.import_module(_TORCHVISION_MODULE)
        return  # torchvision works here: nothing to stand in for
    except ImportError:
        sys.modules.pop(_TORCHVISION_MODULE, None)
    pil = importlib.import_module(_PIL_MODULE)
    shim = types.ModuleType(_TORCHVISION_MODULE, f"stand-in for {_TORCHVISION_MODULE} (ttserve: PIL)")
    for name in dir(pil):
        if not name.startswith("__"):
            setattr(shim, name, getattr(pil, name))
    shim.Qwen2VLImageProcessor = pil.Qwen2VLImageProcessorPil
    sys.modules[_TORCHVISION_MODULE] = shim


def __getattr__(name: str):
    # The vLLM class is built on first access (the registry imports it by this path), so that
    # importing this module for the processor alone does not import vLLM's model code.
    if name == "Qwen2_5_VLForConditionalGeneration":
        cls = _qwen2_5_vl_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


def _qwen2_5_vl_class() -> type:
    stand_in_torchvision_processor()
    from vllm.model_executor.models import qwen2_5_vl
    from vllm.multimodal import MULTIMODAL_REGISTRY

    class ImagesOnlyProcessingInfo(qwen2_5_vl.Qwen2_5_VLProcessingInfo):
        def get_hf_processor(self, **kwargs: object) -> Qwen2_5_VLProcessor:
            return self.ctx.get_hf_processor(ImagesOnlyQwen2_5_VLProcessor, **kwargs)

        def get_supported_mm_limits(self):
            # Images only, no video, as tt-metal's TT_Qwen2_5_VLProcessingInfo (models/demos/qwen25_vl/
            # tt/generator_vllm.py, index ids 6796379906 / 35730477561: {"image": 1, "video": 0}).
            # tt-metal also limits a prompt to one image; ttserve does not (None: no limit): noted.
            return {"image": None}

    @MULTIMODAL_REGISTRY.register_processor(qwen2_5_vl.Qwen2_5_VLMultiModalProcessor,
                                            info=ImagesOnlyProcessingInfo,
                                            dummy_inputs=qwen2_5_vl.Qwen2_5_VLDummyInputsBuilder)
    class Qwen2_5_VLForConditionalGeneration(qwen2_5_vl.Qwen2_5_VLForConditionalGeneration):
        """vLLM's Qwen2.5-VL, registered with the images-only processor (never run: the
        gateway loads no weights; vLLM reads its interfaces and its processor)."""

    Qwen2_5_VLForConditionalGeneration.__module__ = __name__
    return Qwen2_5_VLForConditionalGeneration
