"""Builds `tiny-gemma3`: a tiny random-weight Gemma 3 text checkpoint, offline and deterministic.

Gemma 3 is the hybrid-attention family: local layers attend within a sliding window and use the
local RoPE base, global layers attend to everything with the global base (linear-scaled here, as
the 4B-27B releases are). No small real Gemma installs from the package registries, so the
family is tested on a checkpoint built here with transformers' own Gemma3TextConfig and
Gemma3ForCausalLM (random weights from a fixed seed, float32 safetensors) and the tokenizer and
ChatML template of the embedded SmolLM2.

Chosen so every Gemma 3 term shows in a short CPU test: a 16-token window under prompts of 40+
tokens, six layers alternating two local and one global, query_pre_attn_scalar unlike head_dim, a
final-logit softcap that bites at these weights' scale (logits ~0.7), random norm weights
(transformers initialises Gemma's (1 + w) norms at w = 0, which would hide the offset), and
projections of std 1/sqrt(fan_in) rather than transformers' 0.02, so that activations are of
unit scale and gelu_tanh differs measurably from the exact gelu (embeddings keep 0.02: larger
ones, tied to the head, make greedy decoding repeat the last token). attn_logit_softcapping is
set too, to a value that would bite: transformers and vLLM ignore it for Gemma 3, and so must the
reference model.

The same seed, shapes and transformers version give the same weights: tests and
`ttserve model prepare tiny-gemma3` make the same model.
"""
from __future__ import annotations

from pathlib import Path

ARCHITECTURE = "Gemma3ForCausalLM"
SEED = 1234
SLIDING_WINDOW = 16
LAYER_TYPES = ("sliding_attention", "sliding_attention", "full_attention") * 2
MAX_POSITIONS = 1024


def build(out: Path, tokenizer_source: Path) -> None:
    """Writes the tiny checkpoint into `out` (config, safetensors, tokenizer, generation config).

    `tokenizer_source` is a Hugging Face folder whose tokenizer is reused (the prepared SmolLM2)."""
    import torch
    import transformers

    from .model_prepare import _make_tokenizer_config_portable

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_source)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = transformers.Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        max_position_embeddings=MAX_POSITIONS, rms_norm_eps=1e-6, sliding_window=SLIDING_WINDOW,
        layer_types=list(LAYER_TYPES),
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}},
        attn_logit_softcapping=3.0, final_logit_softcapping=1.0, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    config.architectures = [ARCHITECTURE]
    torch.manual_seed(SEED)
    model = transformers.Gemma3ForCausalLM(config).to(torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # norms scale by (1 + w): random w around 0
                param.copy_(0.1 * torch.randn_like(param))
            elif name.endswith("proj.weight"):  # unit-scale activations (see the module docstring)
                param.normal_(0.0, param.shape[1] ** -0.5)
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=eos)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.model_max_length = MAX_POSITIONS
    tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out, tokenizer.chat_template)
    _check(out, eos)


def _check(out: Path, eos: int) -> None:
    """The folder loads back as written: local and global layers with the window, and a chat
    template that ends the turn with the end-of-sequence token."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    if (tuple(config.layer_types) != LAYER_TYPES or config.sliding_window != SLIDING_WINDOW
            or eos not in ids or tokenizer.eos_token_id != eos):
        raise RuntimeError(f"tiny-gemma3 check failed: layer_types {config.layer_types}, window "
                           f"{config.sliding_window}, eos {tokenizer.eos_token_id} (want {eos}), "
                           f"eos in the chat template's turn: {eos in ids}")
