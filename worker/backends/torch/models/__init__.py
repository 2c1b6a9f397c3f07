"""Reference models in torch that speak tt-metal's generator contract (docs/architecture.md, "The worker").

Keyed by the checkpoint's declared architecture (config.json "architectures"), not its name.
"""
from .gemma3 import TorchGemma3ForCausalLM
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
    "Gemma3ForCausalLM": TorchGemma3ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": TorchQwen2_5_VLForConditionalGeneration,
}

__all__ = ["REFERENCE_ARCHITECTURES", "TorchGemma3ForCausalLM", "TorchLlamaForCausalLM", "TorchMistralForCausalLM",
           "TorchQwen2ForCausalLM", "TorchQwen2_5_VLForConditionalGeneration", "TorchQwen3ForCausalLM"]
