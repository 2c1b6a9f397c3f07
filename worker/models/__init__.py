"""Reference models in torch that speak tt-metal's generator contract (DESIGN.md §3).

Keyed by the checkpoint's declared architecture (config.json "architectures"), not its name.
"""
from ttserve.worker.models.llama import (
    TorchLlamaForCausalLM,
    TorchMistralForCausalLM,
    TorchQwen2ForCausalLM,
    TorchQwen3ForCausalLM,
)

REFERENCE_ARCHITECTURES: dict[str, type[TorchLlamaForCausalLM]] = {
    "LlamaForCausalLM": TorchLlamaForCausalLM,
    "Qwen2ForCausalLM": TorchQwen2ForCausalLM,
    "Qwen3ForCausalLM": TorchQwen3ForCausalLM,
    "MistralForCausalLM": TorchMistralForCausalLM,
}

__all__ = ["REFERENCE_ARCHITECTURES", "TorchLlamaForCausalLM", "TorchMistralForCausalLM",
           "TorchQwen2ForCausalLM", "TorchQwen3ForCausalLM"]
