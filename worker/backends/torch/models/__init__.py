"""Reference models in torch that speak tt-metal's generator contract (docs/architecture.md, "The worker").

Keyed by the checkpoint's declared architecture (config.json "architectures"), not its name.
"""
from .llama import (
    TorchLlamaForCausalLM,
    TorchMistralForCausalLM,
    TorchQwen2ForCausalLM,
    TorchQwen3ForCausalLM,
)
from .qwen2_5_vl import TorchQwen2_5_VLForConditionalGeneration

REFERENCE_ARCHITECTURES: dict[str, type[TorchLlamaForCausalLM]] = {
    "LlamaForCausalLM": TorchLlamaForCausalLM,
    "Qwen2ForCausalLM": TorchQwen2ForCausalLM,
    "Qwen3ForCausalLM": TorchQwen3ForCausalLM,
    "MistralForCausalLM": TorchMistralForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": TorchQwen2_5_VLForConditionalGeneration,
}

__all__ = ["REFERENCE_ARCHITECTURES", "TorchLlamaForCausalLM", "TorchMistralForCausalLM",
           "TorchQwen2ForCausalLM", "TorchQwen2_5_VLForConditionalGeneration", "TorchQwen3ForCausalLM"]
