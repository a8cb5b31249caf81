"""The packed tiles of a CPU model moved onto 2 MiB pages (executor/huge_pages.py)."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire.executor import huge_pages
from pagewire.kernels import native, quant
from pagewire.kernels.linear import Linear


def _model(lib) -> torch.nn.Module:
    """Two tiled linears (3 MiB of tiles: one whole huge page at least) and a float one."""
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(Linear(512, 2048), Linear(512, 1024), Linear(8, 8))
    for linear in model[:2]:
        w = torch.randn(linear.out_features, 512, generator=g).bfloat16()
        linear.use_quantized(quant.pack_bf16(w, lib), 64)
    return model


def _huge_bytes(start: int, end: int) -> int:
    """AnonHugePages of the mappings that meet [start, end), in bytes."""
    total, meets = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and len(line.split()) >= 5:
            lo, hi = (int(v, 16) for v in head.split("-"))
            meets = lo < end and start < hi
        elif head == "AnonHugePages:" and meets:
            total += int(line.split()[1]) * 1024
    return total


def test_tiles_move_onto_huge_pages_with_values_and_tables_kept(monkeypatch):
    lib = native.load()
    if lib is None or not quant.available(lib):
        pytest.skip("no native quantized matmuls here")
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    model = _model(lib)
    x = torch.randn(3, 512).bfloat16()
    before = [quant.matmul(x, m.quantized) for m in model[:2]]
    tiles = [m.quantized.tiles for m in model[:2]]
    copies = [t.clone() for t in tiles]
    moved = huge_pages.back_model(model)
    assert moved == sum(t.numel() for t in copies)                # 64-byte multiples already
    for m, t, copy, out in zip(model[:2], tiles, copies, before):
        assert m.quantized.tiles is t and torch.equal(t, copy)    # the same tensor, same values
        assert m.quantized.table[2].item() == t.data_ptr()        # the table follows the move
        assert torch.equal(quant.matmul(x, m.quantized), out)
    start = tiles[0].data_ptr()
    assert start % huge_pages.HUGE_PAGE == 0 and tiles[1].data_ptr() == start + tiles[0].numel()
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp) and "[never]" not in open(thp).read():
        assert _huge_bytes(start, start + moved) >= huge_pages.HUGE_PAGE


def test_turned_off_nothing_moves(monkeypatch):
    lib = native.load()
    if lib is None or not quant.available(lib):
        pytest.skip("no native quantized matmuls here")
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "0")
    model = _model(lib)
    address = model[0].quantized.tiles.data_ptr()
    assert huge_pages.back_model(model) == 0
    assert model[0].quantized.tiles.data_ptr() == address
    assert huge_pages.back_model(torch.nn.Sequential(Linear(8, 8))) == 0   # no tiles at all
