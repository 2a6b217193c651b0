"""Memory fit: a KV pool too small for the context lowers an automatic max_model_len, and refuses
an explicit one with the largest length that fits. A tiny random model, a tiny pool."""

from __future__ import annotations

import pytest
from conftest import make_tiny_model

# TINY in conftest: 2 layers, 2 KV heads, head_dim 16, fp32: 2 * 2 * 2 * 16 * 4 = 512 bytes a
# token, 8 KiB a block of 16. 80 KiB is 10 blocks: 160 tokens, against 512 positions.
POOL = 80 << 10
FITS = 160


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model("llama", tmp_path_factory.mktemp("fit") / "llama"))


def runner(model: str, **kw):
    from kiln.engine.model_runner import ModelRunner
    from kiln.models.loader import open_checkpoint
    from kiln.settings.engine_config import EngineConfig

    cfg = EngineConfig.of(model=model, dtype="float32", max_num_batched_tokens=32, **kw)
    return ModelRunner(cfg, open_checkpoint(model))


def test_auto_max_model_len_is_lowered_to_what_the_pool_holds(tiny):
    from kiln.engine.engine import Engine, PromptTooLongError
    from kiln.sampling_params import SamplingParams
    from kiln.settings.engine_config import EngineConfig

    r = runner(tiny, kv_cache_memory=POOL)
    assert r.kv_bytes_per_token() == 512 and r.plan.num_blocks == 10
    assert r.plan.token_capacity == FITS and r.max_model_len == FITS
    assert [w.fields for w in r.plan.warnings if w.key == "memory.context_lowered"] == [
        {"max_len": 512, "fits": FITS}]
    eng = Engine(EngineConfig.of(model=tiny, dtype="float32", max_num_batched_tokens=32),
                 runner=r)
    assert eng.max_model_len == FITS
    with pytest.raises(PromptTooLongError) as e:
        eng.add_request("r", [1] * 150, SamplingParams(max_tokens=20))
    assert e.value.code == "context_length_exceeded" and e.value.max_model_len == FITS
    eng.add_request("ok", [1] * 150, SamplingParams(max_tokens=9, temperature=0.0))
    while eng.has_unfinished:
        eng.step()


def test_explicit_max_model_len_that_does_not_fit_names_the_largest_that_does(tiny):
    from kiln.errors import MemoryFitError

    with pytest.raises(MemoryFitError) as e:
        runner(tiny, kv_cache_memory=POOL, max_model_len=512, max_model_len_explicit=True)
    assert e.value.code == "memory.context_does_not_fit" and "--max-model-len 512" in str(e.value)
    assert e.value.hint.key == "memory.context_does_not_fit.hint"
    assert e.value.hint.fields["fits"] == FITS and f"--max-model-len {FITS}" in e.value.hint
    r = runner(tiny, kv_cache_memory=POOL, max_model_len=FITS, max_model_len_explicit=True)
    assert r.max_model_len == FITS and not r.plan.warnings


def test_a_pool_smaller_than_one_block_is_refused(tiny):
    from kiln.errors import MemoryFitError

    with pytest.raises(MemoryFitError) as e:
        runner(tiny, kv_cache_memory=4 << 10)
    assert e.value.code == "memory.context_does_not_fit"
    assert e.value.hint.key == "memory.kv_too_small.hint"  # give the KV cache more memory


def test_max_model_len_counts_as_explicit_only_when_the_user_set_it():
    from kiln.settings.engine_config import EngineConfig
    from kiln.settings.resolve import resolve_settings

    auto = EngineConfig.from_settings(resolve_settings(), model="m")
    assert not auto.max_model_len_explicit
    cli = resolve_settings(cli={"max_model_len": ("1024", "--max-model-len")})
    cfg = EngineConfig.from_settings(cli, model="m")
    assert cfg.max_model_len == 1024 and cfg.max_model_len_explicit


def test_cpu_kv_pool_costs_memory_only_as_it_is_written():
    """CPU KV tensors come from anonymous mmaps: zeroed, resident only where written, and
    kept alive by the tensor itself."""
    import gc

    import torch

    from kiln.engine.memory import kv_zeros
    from kiln.resolve.hardware import rss_bytes

    def rss_kib() -> int:
        return rss_bytes() // 1024

    before = rss_kib()
    pool = kv_zeros((16384, 4, 64), torch.bfloat16, torch.device("cpu"))  # 8 MiB x 16 = 128 MiB
    assert pool.shape == (16384, 4, 64) and pool.dtype == torch.bfloat16
    gc.collect()  # no other reference to the map exists: the tensor's must keep it mapped
    assert rss_kib() - before < 16 * 1024  # nothing resident yet
    pool[:1024] = 1.5  # 512 KiB written
    assert rss_kib() - before < 16 * 1024
    assert float(pool[:1024].float().mean()) == 1.5
    assert not bool(pool[1024:].any())  # the rest reads as zeros



def test_activation_peak_is_measured_once_per_configuration(tiny, tmp_path, monkeypatch):
    """The profiling prefill that measures the activation peak runs at the first start of a
    configuration; a second start with the same model file and settings reads the figure back
    (and says so in the pool's reason), a changed setting measures again."""
    from kiln.engine import memory

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    runs = []
    measure = memory.measure_activation_peak

    def counting(device, forward):
        runs.append(1)
        return measure(device, forward)

    monkeypatch.setattr(memory, "measure_activation_peak", counting)
    first, second = runner(tiny), runner(tiny)
    assert len(runs) == 1
    assert second.plan.activation_bytes == first.plan.activation_bytes
    peaks = str(tmp_path / memory.PEAK_CACHE)  # the reason names the file it read back
    assert peaks not in first.plan.reason and peaks in second.plan.reason
    assert len(list((tmp_path / memory.PEAK_CACHE).glob("*.json"))) == 1
    runner(tiny, max_num_seqs=3)
    assert len(runs) == 2


def test_weights_move_to_huge_pages_keeping_values_and_ties(tmp_path):
    """memory.weights_on_huge_pages: the large CPU weights are copied into one map advised for
    transparent huge pages, bit for bit, tied weights (one storage, two views) still one
    storage; small tensors and views of a mapped file stay where they are."""
    import torch
    from torch import nn

    from kiln.engine import memory

    m = nn.Module()
    m.a = nn.Linear(256, 512)  # weight 512 KiB: moves; bias 2 KiB: stays
    m.b = nn.Linear(512, 256, bias=False)
    m.b.weight = nn.Parameter(m.a.weight.detach().t(), requires_grad=False)  # tied: a view
    path = tmp_path / "w.bin"
    torch.arange(1 << 18, dtype=torch.int32).numpy().tofile(path)
    m.register_buffer("mapped", torch.from_file(str(path), shared=False, size=1 << 18,
                                                dtype=torch.int32))
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ptrs = {k: v.data_ptr() for k, v in m.state_dict().items()}
    moved = memory.weights_on_huge_pages(m)
    after = m.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert m.b.weight.data_ptr() == m.a.weight.data_ptr()  # still tied
    assert m.b.weight.stride() == (1, 256) and isinstance(m.b.weight, nn.Parameter)
    assert after["a.bias"].data_ptr() == ptrs["a.bias"]
    if moved:  # THP on here (`madvise` or `always`)
        assert moved == m.a.weight.numel() * 4
        assert after["a.weight"].data_ptr() != ptrs["a.weight"]
        assert after["mapped"].data_ptr() == ptrs["mapped"]  # file pages are not copied
        assert after["a.weight"].data_ptr() % 4096 == 0
def test_moved_weights_are_mapped_from_the_tile_cache_at_the_next_start(tmp_path,
                                                                        monkeypatch):
    """weights_on_huge_pages with a tile cache (kiln/layers/tile_cache.py): the first start
    copies the weights to huge pages and writes the copy to the cache; the next start with the
    same bytes maps that file instead of copying (its tensors are file memory, values and ties
    kept); a start whose later storage differs (another kiln's packing under the same slots)
    keeps the equal ones mapped, copies the rest anew and rewrites the file, which the start
    after maps whole."""
    import json

    import torch
    from torch import nn

    from kiln.engine import memory
    from kiln.layers import tile_cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tile_cache, "MIN_WEIGHTS_BYTES", 0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")

    def model(seed: int) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Module()
        m.a = nn.Linear(256, 512)  # weight 512 KiB: moves; bias 2 KiB: stays
        m.b = nn.Linear(512, 256, bias=False)
        m.b.weight = nn.Parameter(m.a.weight.detach().t(), requires_grad=False)  # tied
        torch.manual_seed(seed)
        m.c = nn.Linear(256, 256, bias=False)  # the second storage: differs by seed
        return m

    def start(seed: int) -> tuple[nn.Module, tile_cache.TileCache, int]:
        m, cache = model(seed), tile_cache.TileCache.for_file(gguf)
        moved = memory.weights_on_huge_pages(m, cache=cache)
        cache.wait()
        return m, cache, moved

    def on_file(t: torch.Tensor) -> bool:
        return memory._in_ranges(t.data_ptr(), memory._file_maps())

    _, cache, moved = start(0)
    if not moved:  # THP off here (`never`): nothing moves, nothing is cached
        assert not cache.folder.exists()
        return
    assert not cache.weights_hit and len(list(cache.folder.glob("weights-*.bin"))) == 1
    second, cache, moved = start(0)
    assert cache.weights_hit and moved == (512 * 256 + 256 * 256) * 4
    assert on_file(second.a.weight) and on_file(second.c.weight)  # the cache's file, mapped
    want = model(0)
    assert torch.equal(second.a.weight, want.a.weight)
    assert torch.equal(second.c.weight, want.c.weight)
    assert second.b.weight.data_ptr() == second.a.weight.data_ptr()
    assert second.b.weight.stride() == (1, 256)
    third, cache, _ = start(1)  # c's bytes differ: a mapped, c copied, the file rewritten
    assert not cache.weights_hit and on_file(third.a.weight) and not on_file(third.c.weight)
    assert torch.equal(third.c.weight, model(1).c.weight)
    fourth, cache, _ = start(1)
    assert cache.weights_hit and on_file(fourth.c.weight)
    assert torch.equal(fourth.c.weight, model(1).c.weight)
    # a write also removes the folders of model files that are gone
    gone = cache.folder.parent / "gone"
    gone.mkdir()
    (gone / "source.json").write_text(json.dumps({"path": str(tmp_path / "deleted.gguf")}))
    start(2)
    assert not gone.exists() and cache.folder.exists()


def test_stacks_the_tile_cache_keeps_apart_stay_out_of_its_weights_file(tmp_path, monkeypatch):
    """A first start's MoE stacks (packed onto 2 MiB pages by empty_on_huge_pages, `apart`:
    the tile cache writes them as layer files) stay where they are and out of the weights
    file, so the next start, where they are the cache's file maps, asks for the same file and
    maps it; writing a weights file removes the model's other one (no start of these storages
    would read it)."""
    import mmap

    import torch
    from torch import nn

    from kiln.engine import memory
    from kiln.layers import tile_cache

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(tile_cache, "MIN_WEIGHTS_BYTES", 0)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    torch.manual_seed(0)
    dense = torch.randn(512, 256)
    stack = torch.randint(0, 256, (4, 64 << 10), dtype=torch.uint8)

    def model(stack_tensor: torch.Tensor) -> nn.Module:
        m = nn.Module()
        m.register_buffer("dense", dense.clone())
        m.register_buffer("stack", stack_tensor)
        return m

    packed = tile_cache.empty_on_huge_pages(tuple(stack.shape))
    assert packed.data_ptr() % (2 << 20) == 0 and packed.shape == stack.shape
    packed.copy_(stack)
    first, cache = model(packed), tile_cache.TileCache.for_file(gguf)
    cache.folder.mkdir(parents=True)
    (cache.folder / "weights-000000000000.bin").write_bytes(b"an older kiln's")
    moved = memory.weights_on_huge_pages(
        first, cache=cache, apart={first.stack.untyped_storage().data_ptr()})
    cache.wait()
    if not moved:  # THP off here (`never`): nothing moves, nothing is cached
        return
    assert moved == dense.nbytes and first.stack.data_ptr() == packed.data_ptr()
    assert torch.equal(first.stack, stack)
    files = list(cache.folder.glob("weights-*.bin"))
    assert len(files) == 1 and files[0].stat().st_size == dense.nbytes  # the stack left out
    # the next start: the stack is a file map (the layer file the cache wrote)
    layer = tmp_path / "layer0.bin"
    layer.write_bytes(stack.numpy().tobytes())
    with open(layer, "r+b") as f:
        mm = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE)
    second = model(torch.frombuffer(mm, dtype=torch.uint8).view(stack.shape))
    cache = tile_cache.TileCache.for_file(gguf)
    assert memory.weights_on_huge_pages(second, cache=cache) == dense.nbytes
    assert cache.weights_hit and torch.equal(second.dense, dense)
    assert list(cache.folder.glob("weights-*.bin")) == files


def test_the_tile_cache_writes_whole_2mib_blocks_with_every_piece_in_place(tmp_path):
    """tile_cache._write_file writes 2 MiB-aligned blocks (the page cache keeps a write's bytes on
    folios no larger than the write, and a map reads small folios through 4 KiB entries): a
    block inside one large piece straight from it, a block of several small pieces (the weights
    file's attention matrices) gathered, gaps zero; the file holds every piece at its offset and
    ends where the last one does."""
    import torch

    from kiln.layers import tile_cache

    mib = 1 << 20
    torch.manual_seed(0)

    def piece(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8)

    # a 5 MiB piece from 0 (two whole blocks of its own, then a shared one), small pieces
    # after it and across the 6 MiB boundary, a gap, a piece ending mid-block
    pieces = [(piece(5 * mib), 0), (piece(600 << 10), 5 * mib + 4096),
              (piece(150 << 10), 6 * mib - (64 << 10)), (piece(3 * mib + 123), 7 * mib)]
    path = tmp_path / "w.bin"
    tile_cache._write_file(path, pieces)
    data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
    assert data.numel() == 10 * mib + 123
    expected = torch.zeros(10 * mib + 123, dtype=torch.uint8)
    for t, o in pieces:
        expected[o:o + t.numel()] = t
    assert torch.equal(data, expected)
    assert not list(tmp_path.glob("*.tmp*"))  # renamed into place
