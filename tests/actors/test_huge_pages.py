"""The packed tiles of a CPU model moved onto 2 MiB pages (executor/huge_pages.py)."""
from __future__ import annotations

import os

import pytest
import torch

from pagewire.executor import huge_pages
from pagewire.kernels import native, quant
from pagewire.kernels.linear import Linear


@pytest.fixture
def tiled_model() -> torch.nn.Module:
    """Two tiled linears (3 MiB of tiles: one whole huge page at least) and a float one."""
    lib = native.load()
    if lib is None or not quant.available(lib):
        pytest.skip("no native quantized matmuls here")
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(Linear(512, 2048), Linear(512, 1024), Linear(8, 8))
    for linear in model[:2]:
        w = torch.randn(linear.out_features, 512, generator=g).bfloat16()
        linear.use_quantized(quant.pack_bf16(w, lib), 64)
    return model


def _smaps_bytes(field: str, start: int, end: int) -> int:
    """/proc/self/smaps' `field` (AnonHugePages, Rss, ...) over the mappings that meet
    [start, end), in bytes."""
    total, meets = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and len(line.split()) >= 5:
            lo, hi = (int(v, 16) for v in head.split("-"))
            meets = lo < end and start < hi
        elif head == field + ":" and meets:
            total += int(line.split()[1]) * 1024
    return total


def _huge_bytes(start: int, end: int) -> int:
    return _smaps_bytes("AnonHugePages", start, end)


def test_tiles_move_onto_huge_pages_with_values_and_tables_kept(monkeypatch, tiled_model):
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    model = tiled_model
    x = torch.randn(3, 512).bfloat16()
    before = [quant.matmul(x, m.quantized) for m in model[:2]]
    tiles = [m.quantized.tiles for m in model[:2]]
    copies = [t.clone() for t in tiles]
    kept = []
    moved = huge_pages.back_model(model, kept)
    assert len(kept) == 1                                        # the mapping, for its owner
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


def test_turned_off_nothing_moves(monkeypatch, tiled_model):
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "0")
    model = tiled_model
    address = model[0].quantized.tiles.data_ptr()
    assert huge_pages.back_model(model, []) == 0
    assert model[0].quantized.tiles.data_ptr() == address
    assert huge_pages.back_model(torch.nn.Sequential(Linear(8, 8)), []) == 0   # no tiles at all


def test_less_than_a_huge_page_stays(monkeypatch):
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    small = torch.arange(1000, dtype=torch.float32)
    address = small.data_ptr()
    assert huge_pages.move([small]) is None and small.data_ptr() == address


def test_an_adapter_moves_with_its_views_and_table(monkeypatch):
    """A loaded adapter's A and B^T (executor/lora.py Loaded): parts are views of the moved
    B^T, the native table points at the new places, the torch reference's deltas unchanged."""
    from pagewire.executor.lora import Loaded
    from pagewire.kernels.lora import LoraWeights, lora_delta
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    g = torch.Generator().manual_seed(1)
    a = torch.randn(32, 4096, generator=g)                        # 512 KiB each, 4 linears
    weights = {slot: LoraWeights(a.clone(), [(0, torch.randn(16, 3000, generator=g)),
                                             (3000, torch.randn(16, 1000, generator=g))],
                                 0.5, 4000)
               for slot in range(4)}
    x, rows = torch.randn(3, 4096, generator=g), torch.tensor([0, 2])
    before = torch.zeros(3, 4000)
    lora_delta(before, x, [(weights, rows)], 2)
    loaded = Loaded(weights, num_slots=4, generation=0)
    assert loaded.arena is not None
    lw = weights[2]
    assert lw.a.data_ptr() % 64 == 0 and loaded.table[2, 0].item() == lw.a.data_ptr()
    assert loaded.table[2, 1].item() == lw.bt.data_ptr()
    assert lw.parts[1][3].data_ptr() == lw.bt.data_ptr() + 16 * 3000 * 4   # a view of bt
    after = torch.zeros(3, 4000)
    lora_delta(after, x, [(weights, rows)], 2)
    assert torch.equal(after, before)


def test_the_cpu_kv_pool_lies_on_huge_pages_zeroed(monkeypatch):
    """allocate_kv_cache: each layer's [2, blocks, bs, Hkv, width] zeroed in one mapping on
    huge pages, a cache line apart at least, writable apart; off, or under a huge page, plain
    tensors as before."""
    from pagewire.executor.kv_blocks import allocate_kv_cache
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    caches = allocate_kv_cache(3, 257, 16, 2, 68, torch.int8)    # 1.1 MiB a layer
    assert [c.shape for c in caches] == [(2, 257, 16, 2, 68)] * 3
    assert all(c.dtype == torch.int8 and c.is_contiguous() and not c.any() for c in caches)
    starts = [c.data_ptr() for c in caches]
    assert starts[0] % huge_pages.HUGE_PAGE == 0
    assert starts[1] - starts[0] == starts[2] - starts[1] == (caches[0].nbytes + 63) // 64 * 64
    caches[1][1, 256] = 7                                       # the last row of a layer
    assert caches[0].sum() == 0 and caches[2].sum() == 0 and caches[1].sum() == 7 * 16 * 2 * 68
    thp = "/sys/kernel/mm/transparent_hugepage/enabled"
    if os.path.exists(thp) and "[never]" not in open(thp).read():
        for c in caches:            # written: backed, on huge pages (mapped unwritten at start)
            c.fill_(1)
        assert _huge_bytes(starts[0], starts[2] + caches[2].nbytes) >= huge_pages.HUGE_PAGE
    assert huge_pages.zeros(2, (2, 8, 16, 2, 64), torch.bfloat16) is None   # 64 KiB a layer
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "0")
    assert huge_pages.zeros(3, (2, 257, 16, 2, 68), torch.int8) is None
    plain = allocate_kv_cache(3, 257, 16, 2, 68, torch.int8)
    assert [c.shape for c in plain] == [(2, 257, 16, 2, 68)] * 3 and not any(c.any() for c in plain)


def _resident(start: int, end: int) -> int:
    return _smaps_bytes("Rss", start, end)


def test_the_kv_pool_takes_memory_as_it_fills(monkeypatch):
    """A 96 MiB pool is not written at start (a fresh mapping reads as zeros): resident
    memory grows with the blocks written, so a large `--kv-cache-memory auto` pool costs
    neither start-up time nor memory until it is used."""
    from pagewire.executor.kv_blocks import allocate_kv_cache
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    caches = allocate_kv_cache(2, 3072, 16, 8, 64, torch.bfloat16)     # 48 MiB a layer
    start, end = caches[0].data_ptr(), caches[1].data_ptr() + caches[1].nbytes
    assert _resident(start, end) <= 2 * huge_pages.HUGE_PAGE
    caches[0][:, :1024] = 1.0                # a third of layer 0's blocks: 2 x 16 MiB
    grown = _resident(start, end)
    assert 32 << 20 <= grown <= 36 << 20, grown
    assert caches[1].sum() == 0 and caches[0][:, 1024:].sum() == 0


def test_cached_tiles_are_read_onto_huge_pages_and_stay_there(monkeypatch, tmp_path,
                                                              tiled_model):
    """The tile cache is read straight into one huge-page mapping (huge_pages.place), so
    back_model finds them there and moves nothing: same values, same products."""
    from pagewire.executor import tile_cache
    monkeypatch.setenv("PAGEWIRE_HUGE_PAGES", "1")
    monkeypatch.setenv("PAGEWIRE_CACHE_DIR", str(tmp_path))
    model, lib = tiled_model, native.load()
    x = torch.randn(3, 512).bfloat16()
    before = [quant.matmul(x, m.quantized) for m in model[:2]]
    tile_cache.store("d1", "tiles-test", {"0": model[0].quantized, "1": model[1].quantized})
    loaded = tile_cache.load("d1", "tiles-test", lib)
    tiles = [loaded[n].segments[0].tiles for n in ("0", "1")]
    assert all(huge_pages.on_huge_pages(t) for t in tiles)
    assert tiles[0].data_ptr() % huge_pages.HUGE_PAGE == 0 and tiles[1].data_ptr() % 64 == 0
    for m, name in zip(model[:2], ("0", "1")):
        m.use_quantized(loaded[name], 64)
    addresses, kept = [t.data_ptr() for t in tiles], []
    assert huge_pages.back_model(model, kept) == sum(t.numel() for t in tiles)
    assert kept == []
    assert [m.quantized.segments[0].tiles.data_ptr() for m in model[:2]] == addresses
    for m, out in zip(model[:2], before):
        assert torch.equal(quant.matmul(x, m.quantized), out)
