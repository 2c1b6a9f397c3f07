"""A decode step captured as a CUDA graph and replayed with new inputs: torch's counterpart of a
ttnn decode trace.

The captured function must have static shapes and must not synchronize with the host (no
`.item()`, `.tolist()`, `nonzero()`, no branching on tensor values); its inputs are copied into
buffers the graph owns before each replay. The graph's output buffer is overwritten by the next
replay, so callers consume it (index, sample, copy) before replaying again.
"""
from __future__ import annotations

from typing import Callable

import torch

StaticDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class DecodeGraph:
    """One CUDA graph of `forward(tokens [R, 1], start_pos [R], page_table [R, W]) -> logits`."""

    def __init__(self, forward: StaticDecode, rows: int, width: int, device: torch.device,
                 warmup_iterations: int = 2) -> None:
        # Position -1 everywhere: the captured warmup writes only the scratch block.
        self.tokens = torch.zeros(rows, 1, dtype=torch.long, device=device)
        self.start_pos = torch.full((rows,), -1, dtype=torch.long, device=device)
        self.page_table = torch.zeros(rows, width, dtype=torch.long, device=device)
        # Run on a side stream first (lazy initialization, the caching allocator's first
        # blocks), as torch.cuda.graphs requires, then capture on it.
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(warmup_iterations):
                forward(self.tokens, self.start_pos, self.page_table)
        torch.cuda.current_stream(device).wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = forward(self.tokens, self.start_pos, self.page_table)

    def fits(self, tokens: torch.Tensor, page_table: torch.Tensor) -> bool:
        return tokens.shape[0] == self.tokens.shape[0] and page_table.shape == self.page_table.shape

    def replay(self, tokens: torch.Tensor, start_pos: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens.reshape(self.tokens.shape), non_blocking=True)
        self.start_pos.copy_(start_pos.reshape(self.start_pos.shape), non_blocking=True)
        self.page_table.copy_(page_table, non_blocking=True)
        self.graph.replay()
        return self.logits
