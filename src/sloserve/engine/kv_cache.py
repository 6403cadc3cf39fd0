"""The engine's KV cache: one tensor of token slots on the device and one in CPU swap space.

Slot ids come from the scheduler's KV manager (block ``b`` holds slots ``b * block_size ...``), so
every manager's layout is a real memory layout here. Swaps in a ``SchedulerOutput`` are block copies.
"""

from __future__ import annotations

import torch

from sloserve.checkpoint.model_config import ModelConfig
from sloserve.core.outputs import BlockCopy, SlotCopy
from sloserve.engine.async_scheduling import to_device


class KVCacheTensor:
    """``gpu``: (2, layers, num_slots + block_size, kv_heads, head_dim) on the device, K then V; ``cpu``:
    the same shape with the swap space's slots, in host memory (pinned when the device is CUDA).

    A model whose values are its keys' first numbers (MLA's latent: ``ModelConfig.kv_cache_value_dim``)
    has keys only: (1, layers, ...), half the memory a token (``layer_caches`` gives None for its V).

    The last device block, from ``pad_slot`` = ``num_slots`` on, belongs to no request: the padding
    rows of a CUDA-graph batch (``cuda_graphs.DecodeGraphs``, ``piecewise_graphs.PiecewiseGraphs``)
    write and read their K/V at ``pad_slot``, and a decode graph's padding block-id row names this
    block, so every slot it expands to exists. NOTE: ``gpu`` is allocated once and only ever written in
    place, because a captured graph holds its address.
    """

    def __init__(
        self,
        config: ModelConfig,
        num_slots: int,
        num_cpu_slots: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        shape = (
            config.kv_cache_tensors,
            config.num_kv_layers,  # (the attention layers': a Mamba layer keeps states, ``StateCache``)
            num_slots + block_size,
            config.kv_cache_heads,
            config.kv_cache_head_dim,
        )
        self.gpu = torch.zeros(shape, dtype=dtype, device=device)
        self.pad_slot = num_slots
        cpu_shape = (*shape[:2], num_cpu_slots, *shape[3:])
        self.cpu = torch.zeros(cpu_shape, dtype=dtype, pin_memory=device.type == "cuda")
        self.block_size = block_size

    def _slots(self, blocks: list[int]) -> torch.Tensor:
        """(len(blocks) * block_size,) slot ids of ``blocks``."""
        return expand_block_ids(torch.tensor([blocks], dtype=torch.int64), self.block_size)[0]

    def swap_out(self, copies: list[BlockCopy]) -> None:
        """Device blocks -> CPU blocks (the host waits for them: what was queued before included)."""
        if copies:
            src = to_device(self._slots([c.src_block for c in copies]), self.gpu.device)
            dst = self._slots([c.dst_block for c in copies])
            self.cpu[:, :, dst] = self.gpu[:, :, src].cpu()

    def swap_in(self, copies: list[BlockCopy]) -> None:
        """CPU blocks -> device blocks, from pinned memory without blocking the host (``to_device``)."""
        if copies:
            src = self._slots([c.src_block for c in copies])
            dst = to_device(self._slots([c.dst_block for c in copies]), self.gpu.device)
            self.gpu[:, :, dst] = to_device(self.cpu[:, :, src], self.gpu.device)

    def copy_slots(self, copies: list[SlotCopy]) -> None:
        """Single-token copies in order (BROS checkpoints GPU -> CPU and restores CPU -> GPU).

        Consecutive copies in one direction run as one gather/scatter; the CPU buffer grows when a
        checkpoint needs a slot beyond it (host memory is taken to be ample, as in BROS).
        """
        i = 0
        while i < len(copies):
            j = i
            while j < len(copies) and copies[j].to_cpu == copies[i].to_cpu:
                j += 1
            # NOTE: within a run a destination may repeat (a slot freed and reused); the last copy wins.
            run = {c.dst_slot: c.src_slot for c in copies[i:j]}
            dst = torch.tensor(list(run), dtype=torch.int64)
            src = torch.tensor(list(run.values()), dtype=torch.int64)
            if copies[i].to_cpu:
                self._ensure_cpu_slots(int(dst.max()) + 1)
                self.cpu[:, :, dst] = self.gpu[:, :, to_device(src, self.gpu.device)].cpu()
            else:  # (a restore: ``swap_in``'s way)
                self.gpu[:, :, to_device(dst, self.gpu.device)] = to_device(self.cpu[:, :, src], self.gpu.device)
            i = j

    def _ensure_cpu_slots(self, num_slots: int) -> None:
        have = self.cpu.shape[2]
        if num_slots > have:
            shape = list(self.cpu.shape)
            shape[2] = max(num_slots, 2 * have)
            grown = torch.zeros(shape, dtype=self.cpu.dtype, pin_memory=self.cpu.is_pinned())
            grown[:, :, :have] = self.cpu
            self.cpu = grown


def layer_caches(kv_cache: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layer ``layer``'s K and V caches, each (num_slots, kv_heads, head_dim), of ``kv_cache`` (a
    ``KVCacheTensor``'s ``gpu``); V is None in a keys-only cache (MLA's)."""
    return kv_cache[0, layer], (kv_cache[1, layer] if kv_cache.shape[0] == 2 else None)


def expand_block_ids(ids: torch.Tensor, block_size: int) -> torch.Tensor:
    """``(B, n * block_size)`` slot tables from ``(B, n)`` block ids, on their device (the torch twin
    of ``kv.manager.expand_block_ids``, run where the tables are read)."""
    if block_size == 1:
        return ids
    offsets = torch.arange(block_size, dtype=ids.dtype, device=ids.device)  # (block_size,)
    return (ids[:, :, None] * block_size + offsets).flatten(1)
