"""Torch reference implementation of Qwen2.5-VL behind tt-metal's generator contract.

The text model is Qwen2 (llama.py) with multimodal RoPE; the vision tower is Qwen2.5-VL's ViT
(patch embedding, 2-D rotary attention in windows with some full-attention blocks, a merger of
2 x 2 patches into one LLM token). Weights are read from the checkpoint as released
(`model.*` for the text model, `visual.*` for the tower).

The contract is the one of tt-metal's models/demos/qwen25_vl/tt/generator_vllm.py, as the TT
plugin drives it (vllm-tt-plugin model_runner.py `_gather_multi_modal_inputs`, async_decode.py):

* prefill_forward(..., pixel_values=, image_grid_thw=) takes one entry per prefill user: None
  for a text-only user, else a list with one item per image in the row's tokens [0, prompt_len),
  in order. pixel_values[i][k] is the image's patches [n, 3 x 2 x 14 x 14], or None when its
  placeholders lie before start_pos[i] (their KV is cached: no encoder run); image_grid_thw[i][k]
  is its (t, h, w) patch grid [3], always given, because a token's positions depend on every
  image before it. Image k's placeholders are the k-th run of `image_token_id` tokens in the
  row (t*h*w / 4 of them). tt-metal's class takes start_pos 0 only (no prefix caching, no
  chunking); this one takes any chunk that does not start or end inside an image.
* prefill_forward returns (logits or sampled tokens, rope_deltas [B]): a request's decode
  positions are its sequence positions plus its delta (mRoPE compresses an image's positions).
* decode_forward(..., rope_deltas_all_users=) takes the delta of every batch row (None: the
  rows are unchanged since the last call; the model keeps them per row, as tt-metal's
  `update_rope_deltas`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ttserve.worker.sampling import SamplingBatch, sample

from .linear import Linear
from .llama import (CheckpointError, KVCache, LlamaShape, TorchQwen2ForCausalLM, _Checkpoint, _Step,
                    contract_config)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text model's config: transformers 5 nests it under text_config; older releases keep
    it at the top level. mRoPE's rope type reads as the default rotary frequencies."""
    text = {**config, **(config.get("text_config") or {})}
    rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if rope.get("type") == "mrope" or rope.get("rope_type") == "mrope":
        rope.pop("type", None)
        rope["rope_type"] = "default"
    text["rope_parameters"] = rope
    text.pop("rope_scaling", None)
    return text


@dataclass(slots=True)
class _VisionBlock:
    norm1: torch.Tensor
    qkv: Linear
    proj: Linear
    norm2: torch.Tensor
    gate: Linear
    up: Linear
    down: Linear


class VisionTower:
    """Qwen2.5-VL's ViT: pixel patches of some images -> one embedding per placeholder token."""

    def __init__(self, config: dict[str, Any], state: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.hidden = int(config["hidden_size"])
        self.heads = int(config["num_heads"])
        self.patch = int(config["patch_size"])
        self.merge = int(config["spatial_merge_size"])
        self.temporal = int(config["temporal_patch_size"])
        self.window = int(config["window_size"])
        self.full_blocks = set(config.get("fullatt_block_indexes") or ())
        if config.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"vision hidden_act={config.get('hidden_act')!r} is not supported (only silu)")

        def take(name: str) -> torch.Tensor:
            name = f"visual.{name}"
            if name not in state:
                raise CheckpointError(f"checkpoint has no tensor {name!r}")
            return state[name].to(device, dtype)

        def linear(name: str) -> Linear:
            return Linear(take(f"{name}.weight"), take(f"{name}.bias"))

        self.patch_embed = take("patch_embed.proj.weight")  # [hidden, 3, t, p, p]
        self.blocks = [_VisionBlock(
            norm1=take(f"blocks.{i}.norm1.weight"), qkv=linear(f"blocks.{i}.attn.qkv"),
            proj=linear(f"blocks.{i}.attn.proj"), norm2=take(f"blocks.{i}.norm2.weight"),
            gate=linear(f"blocks.{i}.mlp.gate_proj"), up=linear(f"blocks.{i}.mlp.up_proj"),
            down=linear(f"blocks.{i}.mlp.down_proj")) for i in range(int(config["depth"]))]
        self.ln_q = take("merger.ln_q.weight")
        self.merger_in = linear("merger.mlp.0")
        self.merger_out = linear("merger.mlp.2")
        head_dim = self.hidden // self.heads
        theta = float((config.get("rope_parameters") or {}).get("rope_theta", 10000.0))
        spatial = head_dim // 2
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float) / spatial))

    def tokens_of(self, grid: torch.Tensor) -> int:
        t, h, w = (int(v) for v in grid.tolist())
        return t * h * w // (self.merge * self.merge)

    @torch.inference_mode()
    def __call__(self, pixel_values: torch.Tensor, grids: torch.Tensor) -> torch.Tensor:
        """Embeddings [sum of tokens_of(grid), out_hidden] of images whose patches are stacked in
        `pixel_values` [patches, 3 * t * p * p] with patch grids `grids` [images, 3]."""
        unit = self.merge * self.merge
        x = pixel_values.to(self.patch_embed.device, self.dtype).view(
            -1, 3, self.temporal, self.patch, self.patch)
        x = F.conv3d(x, self.patch_embed, stride=self.patch_embed.shape[2:]).view(-1, self.hidden)
        order, window_bounds = self._windows(grids)
        image_bounds = F.pad(torch.repeat_interleave(grids[:, 1] * grids[:, 2], grids[:, 0]).cumsum(0), (1, 0))
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order].reshape(n, -1)
        angles = self._angles(grids).view(n // unit, unit, -1)[order].reshape(n, -1)
        emb = torch.cat([angles, angles], dim=-1)
        cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
        for i, block in enumerate(self.blocks):
            bounds = image_bounds if i in self.full_blocks else window_bounds
            x = x + self._attention(block, _rms(x, block.norm1), cos, sin, bounds.tolist())
            h = _rms(x, block.norm2)
            x = x + block.down(F.silu(block.gate(h)) * block.up(h))
        merged = self.merger_out(F.gelu(self.merger_in(_rms(x, self.ln_q).view(-1, self.hidden * unit))))
        return merged[torch.argsort(order)]

    def _attention(self, block: _VisionBlock, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   bounds: list[int]) -> torch.Tensor:
        n = h.shape[0]
        q, k, v = block.qkv(h).view(n, 3, self.heads, -1).unbind(1)   # [n, heads, head_dim]
        q = (q.float() * cos + _rotate_half(q.float()) * sin).to(h.dtype)
        k = (k.float() * cos + _rotate_half(k.float()) * sin).to(h.dtype)
        out = torch.empty_like(q)
        # Attention within each segment (a window, or a whole image in full-attention blocks).
        for a, b in zip(bounds[:-1], bounds[1:]):
            if b > a:
                out[a:b] = F.scaled_dot_product_attention(
                    q[a:b].transpose(0, 1), k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)).transpose(0, 1)
        return block.proj(out.reshape(n, -1))

    def _angles(self, grids: torch.Tensor) -> torch.Tensor:
        """Rotary angles [patches, head_dim / 2] of each patch's (row, column), laid out block-major
        over the merge x merge blocks (the order of the processor's patches)."""
        m = self.merge
        rows = []
        for t, h, w in grids.tolist():
            hpos, wpos = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            hw = torch.stack([hpos.reshape(shape).transpose(1, 2).flatten(),
                              wpos.reshape(shape).transpose(1, 2).flatten()], dim=-1)
            rows.append(hw.repeat(t, 1))
        pos = torch.cat(rows).float()
        freqs = pos[..., None] * self.inv_freq  # [patches, 2, head_dim / 4]
        return torch.cat([freqs[:, 0], freqs[:, 1]], dim=-1).to(self.patch_embed.device)

    def _windows(self, grids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The order of merged tokens that groups them by attention window, and the windows'
        cumulative patch bounds in that order."""
        side = self.window // self.merge // self.patch  # window side, in merged tokens
        unit = self.merge * self.merge
        order, bounds, base = [], [0], 0
        for t, h, w in grids.tolist():
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).reshape(t, gh, gw)
            pad_h, pad_w = side - gh % side, side - gw % side
            nh, nw = (gh + pad_h) // side, (gw + pad_w) // side
            padded = F.pad(index, (0, pad_w, 0, pad_h), value=-1)
            padded = padded.reshape(t, nh, side, nw, side).permute(0, 1, 3, 2, 4).reshape(t, nh * nw, side * side)
            sizes = (padded >= 0).sum(-1).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat >= 0] + base)
            bounds.extend((sizes.cumsum(0) * unit + bounds[-1]).tolist())
            base += t * gh * gw
        return torch.cat(order), torch.unique_consecutive(torch.tensor(bounds))


class TorchQwen2_5_VLForConditionalGeneration(TorchQwen2ForCausalLM):
    """Qwen2.5-VL: a vision tower feeding Qwen2 with multimodal RoPE."""

    # Images are known from the checkpoint (its vision_config), not from a capability key.
    model_capabilities = dict(TorchQwen2ForCausalLM.model_capabilities)
    allows_cpu_kernels = False
    no_cpu_kernels_reason = "it feeds input embeddings and its own RoPE positions (images, mRoPE)"

    def __init__(self, shape: LlamaShape, state: Mapping[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, max_batch_size: int, max_seq_len: int, lanes: int,
                 config: dict[str, Any] | None = None) -> None:
        config = config or {}
        super().__init__(shape, state, device, dtype, max_batch_size, max_seq_len, lanes)
        text = text_config(config)
        section = list(text["rope_parameters"].get("mrope_section") or ())
        if sum(section) != shape.head_dim // 2:
            raise CheckpointError(f"mrope_section {section} must add up to head_dim / 2 = {shape.head_dim // 2}")
        # Rotary frequency j rotates by the position on axis (temporal, height, width)[its section].
        axis = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(section)])
        self._axis = torch.cat([axis, axis]).to(device)
        self.image_token_id = int(config["image_token_id"])
        self.visual = VisionTower(config["vision_config"], state, device, dtype)
        self._rope_deltas = torch.zeros(lanes * max_batch_size, dtype=torch.long)

    @classmethod
    def initialize_vllm_model(cls, hf_config: Any, mesh_device: torch.device, max_batch_size: int,
                              max_seq_len: int, tt_data_parallel: int = 1, *, model_path: str,
                              dtype: torch.dtype = torch.float32) -> TorchQwen2_5_VLForConditionalGeneration:
        config = contract_config(hf_config, max_batch_size, max_seq_len, tt_data_parallel)
        if "vision_config" not in config or "image_token_id" not in config:
            raise CheckpointError("a Qwen2.5-VL config.json needs vision_config and image_token_id")
        shape = LlamaShape.from_config(text_config(config))
        return cls(shape, _Checkpoint(Path(model_path)), torch.device(mesh_device), dtype,
                   max_batch_size, max_seq_len, tt_data_parallel, config)

    # --- contract ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill_forward(self, tokens: torch.Tensor, page_table: torch.Tensor, kv_cache: KVCache,
                        prompt_lens: Sequence[int] | torch.Tensor,
                        start_pos: Sequence[int] | torch.Tensor | None = None,
                        enable_trace: bool = False, sampling_params: SamplingBatch | None = None,
                        empty_slots: Sequence[int] | None = None,
                        pixel_values: Sequence[Sequence[torch.Tensor | None] | None] | None = None,
                        image_grid_thw: Sequence[Sequence[torch.Tensor] | None] | None = None,
                        **_: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """As TorchLlamaForCausalLM.prefill_forward, with each user's images (see the module
        docstring); returns (logits [B, 1, vocab] or tokens [B], rope_deltas [B])."""
        del enable_trace
        chunk_tokens, start, end, lanes = self._prefill_inputs(tokens, prompt_lens, start_pos, empty_slots)
        step = self._plan(chunk_tokens, start, end, page_table, lanes, kv_cache)
        batch = tokens.shape[0]
        width = step.tokens.shape[1]
        embeds = F.embedding(step.tokens, self.embed)
        rope = torch.zeros(3, batch, width, dtype=torch.long)
        deltas = torch.zeros(batch, dtype=torch.long)
        for i in range(batch):
            pixels = (pixel_values or [None] * batch)[i]
            grids = (image_grid_thw or [None] * batch)[i]
            row = tokens[i, :int(end[i])].cpu().long()
            runs = self._image_runs(row, grids or [])
            positions, deltas[i] = _mrope_positions(len(row), runs, self.visual.merge)
            s, e = int(start[i]), int(end[i])
            rope[:, i, :e - s] = positions[:, s:e]
            for (offset, length, grid), pv in zip(runs, pixels or []):
                if pv is None:
                    if offset + length > s:
                        raise ValueError(f"prefill user {i}: the image at {offset} has no pixel_values "
                                         f"but its placeholders reach past start_pos {s}")
                    continue
                if offset < s or offset + length > e:
                    raise ValueError(f"prefill user {i}: the image at [{offset}, {offset + length}) is "
                                     f"not inside the chunk [{s}, {e}): a chunk may not split an image")
                embeds[i, offset - s:offset - s + length] = self.visual(
                    pv, torch.tensor([grid])).to(embeds.dtype)
        step.embeds = embeds
        step.rope_positions = rope.clamp(0, self.max_seq_len - 1).to(self.device)
        logits = self._forward(step, kv_cache)
        out = sample(logits, sampling_params) if sampling_params is not None else logits.unsqueeze(1)
        rows = list(range(batch)) if empty_slots is None else [int(r) for r in empty_slots]
        self._rope_deltas[rows] = deltas
        return out, deltas

    @torch.inference_mode()
    def decode_forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor,
                       kv_cache: KVCache, enable_trace: bool = False, read_from_device: bool = True,
                       sampling_params: SamplingBatch | None = None,
                       rope_deltas_all_users: Sequence[int] | None = None, **kwargs: Any) -> torch.Tensor:
        """As TorchLlamaForCausalLM.decode_forward; row r rotates at start_pos[r] + its rope delta.
        Always eager over the live rows: per-row rope deltas are not in the static decode."""
        del enable_trace
        self._take_rope_deltas(rope_deltas_all_users)
        return super().decode_forward(tokens, start_pos, page_table, kv_cache, enable_trace=False,
                                      read_from_device=read_from_device, sampling_params=sampling_params,
                                      **kwargs)

    @torch.inference_mode()
    def verify_forward(self, tokens: torch.Tensor, start_pos: Sequence[int] | torch.Tensor,
                       page_table: torch.Tensor, kv_cache: KVCache, num_tokens: Sequence[int] | torch.Tensor,
                       rope_deltas_all_users: Sequence[int] | None = None, **kwargs: Any) -> torch.Tensor:
        """As TorchLlamaForCausalLM.verify_forward; row i rotates its positions by batch row
        empty_slots[i]'s rope delta (rope_deltas_all_users: as decode_forward's)."""
        self._take_rope_deltas(rope_deltas_all_users)
        return super().verify_forward(tokens, start_pos, page_table, kv_cache, num_tokens, **kwargs)

    def _take_rope_deltas(self, rope_deltas_all_users: Sequence[int] | None) -> None:
        """Every batch row's rope delta, when the caller sends them (None: unchanged)."""
        if rope_deltas_all_users is not None:
            deltas = torch.as_tensor(list(rope_deltas_all_users), dtype=torch.long).reshape(-1)
            self._rope_deltas[:len(deltas)] = deltas

    # --- internals ---------------------------------------------------------------------------

    def _decode_rope_offset(self, rows: torch.Tensor) -> torch.Tensor:
        return self._rope_deltas[rows.cpu()]

    def _rope(self, step: _Step) -> tuple[torch.Tensor, torch.Tensor]:
        if step.rope_positions is None:
            return super()._rope(step)
        # [3, B, S, head_dim] tables; frequency j takes the axis its mRoPE section names.
        cos3, sin3 = self._cos[step.rope_positions], self._sin[step.rope_positions]
        pick = self._axis.view(1, 1, 1, -1).expand(1, *cos3.shape[1:])
        return cos3.gather(0, pick)[0].unsqueeze(2), sin3.gather(0, pick)[0].unsqueeze(2)

    def _image_runs(self, row: torch.Tensor, grids: Sequence[torch.Tensor]
                    ) -> list[tuple[int, int, tuple[int, int, int]]]:
        """(offset, length, grid) of each image: image k owns the next tokens_of(grid k)
        placeholder tokens of the row, in order."""
        where = (row == self.image_token_id).nonzero().flatten().tolist()
        runs, used = [], 0
        for grid in grids:
            grid = torch.as_tensor(grid).reshape(-1).long()
            n = self.visual.tokens_of(grid)
            span = where[used:used + n]
            if span and len(span) < n and span[-1] == len(row) - 1:
                raise ValueError(f"the row ends at {len(row)}, inside the placeholders of an image at "
                                 f"{span[0]} ({n} tokens): a chunk may not split an image")
            if len(span) != n or span[-1] - span[0] != n - 1:
                raise ValueError(f"an image of grid {grid.tolist()} needs {n} consecutive placeholder "
                                 f"tokens; the row has {len(where) - used} more")
            runs.append((span[0], n, tuple(grid.tolist())))
            used += n
        if used != len(where):
            raise ValueError(f"the row has {len(where)} image placeholder tokens; its images cover {used}")
        return runs


def _mrope_positions(length: int, runs: list[tuple[int, int, tuple[int, int, int]]], merge: int
                     ) -> tuple[torch.Tensor, int]:
    """Qwen2-VL's 3-D positions [3, length] of a row and its rope delta: text advances all three
    axes by one per token; an image's tokens sit on its (t, h, w) grid from the position after
    the text before it, and the text after it resumes past the grid's larger side."""
    pieces, current, index = [], 0, 0
    for offset, n, (t, h, w) in runs:
        text = offset - index
        pieces.append(torch.arange(text).view(1, -1).expand(3, -1) + current)
        current += text
        gh, gw = h // merge, w // merge
        tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + current)
        current += max(gh, gw)
        index = offset + n
    pieces.append(torch.arange(length - index).view(1, -1).expand(3, -1) + current)
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - length if length else 0
    return positions, delta


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return F.rms_norm(x, x.shape[-1:], weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
