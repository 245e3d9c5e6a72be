"""PyTorch's int4 (groups of 32) and int8 (per row) weight-only matmul kernels, and the int4
weight layouts they take. The layout differs by device: the CPU op packs [N, K] int32, the CUDA
one [N, K/2] uint8 pairs."""

from __future__ import annotations

from functools import lru_cache

import torch

GROUP = 32


def kernels_on(device: torch.device | str) -> bool:
    """Whether the int4/int8 kernels run on `device` (CPU, or CUDA with bf16 tensor cores)."""
    device = torch.device(device)
    if device.type == "cpu":
        return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    if device.type == "cuda":
        return torch.cuda.is_available() and torch.cuda.get_device_capability(device)[0] >= 8
    return False


def _inner_k_tiles(K: int) -> int:
    return next(t for t in (8, 4, 2) if K % (t * 16) == 0)


def pack_int4(q4: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [n, K] (n a multiple of 16, or of 8 on CUDA) -> the device's int4 kernel layout."""
    if q4.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 2)
    pairs = ((q4[:, ::2] << 4) | q4[:, 1::2]).to(torch.uint8)  # untested here: no CUDA on the dev machine
    return torch.ops.aten._convert_weight_to_int4pack(pairs, _inner_k_tiles(q4.shape[1]))


def int4_mm(x: torch.Tensor, packed: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
    if x.device.type == "cpu":
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, GROUP, sz)
    return torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz)


def _unpack_cpu_int4(packed: torch.Tensor, block: int) -> torch.Tensor:
    """Inverse of the CPU packing: blocks of `block` rows store, for each column, bytes whose low
    nibbles are the block's first half of rows and high nibbles its second half; a last partial
    block stores adjacent row pairs."""
    n, K = packed.shape[0], packed.shape[1] * 2
    full = n // block * block
    body = packed[:full].reshape(-1, K, block // 2)
    out = [torch.cat([body & 15, body >> 4], 2).transpose(1, 2).reshape(full, K)]
    if n > full:
        tail = packed[full:].reshape(K, (n - full) // 2)
        out.append(torch.stack([tail & 15, tail >> 4], 2).reshape(K, n - full).t())
    return torch.cat(out)


@lru_cache(maxsize=None)
def cpu_int4_block() -> int | None:
    """Rows per block of this CPU's int4 layout (it follows the vector width), checked by packing
    a probe; None if it is none we know, and then packed int4 weights are never unpacked."""
    g = torch.Generator().manual_seed(0)
    probe = torch.randint(0, 16, (144, 64), dtype=torch.int32, generator=g)
    packed = pack_int4(probe)
    for block in (64, 32, 16):
        if torch.equal(_unpack_cpu_int4(packed, block).int(), probe):
            return block
    return None


def bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16)


def padded(t: torch.Tensor, n: int, value) -> torch.Tensor:
    return t if t.shape[0] == n else torch.cat([t, t.new_full((n - t.shape[0], *t.shape[1:]), value)])


def padded_rows(n: int) -> int:
    """Rows an int4 matrix of n rows is stored with (the kernels take multiples of 16 or 8)."""
    return -(-n // 16) * 16


def unpack_cpu_int4_rows(packed: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Values 0..15 of rows [a, b) of a CPU-packed matrix; a is a multiple of 64 and b is too, or
    the end (a layout block never straddles such a boundary)."""
    return _unpack_cpu_int4(packed[a:b], cpu_int4_block())


def gather_cpu_int4(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Values 0..15 of rows `index` of a CPU-packed matrix, [len(index), K]."""
    block = cpu_int4_block()
    n, half = packed.shape
    full = n // block * block
    k = torch.arange(2 * half, device=index.device)
    index = index.long()
    # full blocks: byte k * block/2 + j % (block/2) of the row's block, high nibble for the 2nd half
    j = index % block
    pos = (index - j)[:, None] * half + k * (block // 2) + (j % (block // 2))[:, None]
    high = j >= block // 2
    # the last partial block: adjacent pairs of rows, high nibble for the odd one
    t = (index - full).clamp(min=0)
    tail = full * half + k * max((n - full) // 2, 1) + (t // 2)[:, None]
    in_tail = index >= full
    pos = torch.where(in_tail[:, None], tail, pos)
    high = torch.where(in_tail, t % 2 == 1, high)
    byte = packed.reshape(-1)[pos]
    return torch.where(high[:, None], byte >> 4, byte & 15)
