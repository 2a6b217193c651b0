"""torch.compile of the decode step: batch buckets, the compiled layer call, warm-up at startup,
and inductor's on-disk cache directory. Which decode steps run these graphs is decided once, in
kiln/engine/decisions.py; the runner only pads a step to its bucket and calls `DecodeGraphs.run`.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kiln.layers.attention import AttentionMetadata, set_context
from kiln.layers.eager import apply_eager_marks

log = logging.getLogger("kiln.runner")

# Decode batches are padded up to one of these (and max_num_seqs), so one graph serves each.
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Cascade decode attention (layers/attention.py) when at least this many decode rows share at
# least this many leading blocks; the warm-up compiles cascade graphs for buckets this large.
CASCADE_MIN_ROWS = 4
CASCADE_MIN_BLOCKS = 4


def decode_buckets(kernel_rows: int, max_num_seqs: int) -> list[int]:
    """The batch buckets that need a compiled graph: those above what kiln's one-call layer
    kernel runs (`kernel_rows`), up to max_num_seqs. Empty when the kernel runs every batch."""
    limit = max(max_num_seqs, 1)
    if limit <= kernel_rows:
        return []
    return [b for b in BUCKETS if kernel_rows < b < limit] + [limit]


class DecodeGraphs:
    """The decode step compiled for each batch bucket, every bucket run once at construction so
    the cost is paid at startup. The context length stays a dynamic dimension, so one graph per
    bucket serves every length. Compiled artifacts are cached on disk (inductor's FX graph cache
    under ~/.cache/kiln/inductor): a second start skips the C++ builds."""

    def __init__(self, model: torch.nn.Module, buckets: list[int], cascade: bool,
                 scratch_block: int, block_size: int, device: torch.device) -> None:
        use_kiln_inductor_cache()
        import torch._dynamo

        apply_eager_marks()  # the MoE layers' routing stays eager inside the graphs
        t0 = time.monotonic()
        self.buckets = buckets
        # Cascade steps have graphs of their own (CPU only: on CUDA that graph is unmeasured,
        # so cascade steps there stay eager).
        self.cascade = cascade
        self.warmed_up = False
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit,
                                                    2 * len(buckets) + 4)
        # Regional compilation: one decoder layer's forward is compiled, and the same graph
        # serves all layers (their weights are graph inputs), so compile time does not grow
        # with depth. Whole-model graphs measured no faster and took ~25x longer to build.
        self.layer_call = torch.compile(fresh_layer_call(), fullgraph=False, dynamic=None)
        for b in buckets:
            self._warm_up(model, b, False, scratch_block, block_size, device)
            if cascade and b >= CASCADE_MIN_ROWS:
                self._warm_up(model, b, True, scratch_block, block_size, device)
        self.warmed_up = True
        self.seconds = time.monotonic() - t0
        log.info("compiled the decode step for batch buckets %s in %.1f s", buckets, self.seconds)

    @torch.inference_mode()
    def _warm_up(self, model: torch.nn.Module, b: int, cascade: bool, scratch_block: int,
                 bs: int, device: torch.device) -> None:
        """One decode step of `b` padding rows (scratch block only): compiles that bucket, or
        its cascade variant (a shared prefix read once)."""
        def dev(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a).to(device)

        scratch = scratch_block * bs
        nkv = 2 * bs  # any length > 1: the dimension is dynamic (0 and 1 would specialize)
        gather = scratch + np.tile(np.arange(nkv, dtype=np.int64) % bs, (b, 1))
        mask = np.zeros((b, nkv), dtype=bool)
        mask[:, 0] = True
        meta = AttentionMetadata(
            slot_mapping=dev(np.full(b, scratch, dtype=np.int64)), num_decodes=b,
            decode_gather=dev(gather), decode_mask=dev(mask)[:, None, None, :])
        if cascade:
            # A length of its own: equal sizes would share one symbol in the graph (dynamo's
            # duck shaping), which then guards that the shared and own parts stay equal.
            p = 3 * bs
            meta.decode_shared = dev(scratch + np.arange(p, dtype=np.int64) % bs)
        ids = torch.zeros(b, dtype=torch.long, device=device)
        set_context(meta)
        try:
            self.run(model, ids, torch.zeros_like(ids), meta)
        finally:
            set_context(None)

    def run(self, model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata) -> torch.Tensor:
        """The model over a decode-only step padded to a bucket, each layer through the graph."""
        assert meta.decode_gather is not None and meta.decode_mask is not None
        import torch._dynamo

        # The batch is static (bucketed); the context length is the one dynamic dimension.
        torch._dynamo.mark_dynamic(meta.decode_gather, 1)
        torch._dynamo.mark_dynamic(meta.decode_mask, 3)
        if meta.decode_shared is not None:
            torch._dynamo.mark_dynamic(meta.decode_shared, 0)
        with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
            if not self.warmed_up:
                return model(input_ids, positions, layer_call=self.layer_call)
            # Every bucket was compiled at startup and the context length is dynamic, so no step
            # can need a new graph: only the guards that tell the buckets apart are checked.
            # Full guard evaluation measured ~37 us per layer call, ~1.1 ms of a ~11 ms step.
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                return model(input_ids, positions, layer_call=self.layer_call)


def use_kiln_inductor_cache() -> None:
    """Points inductor's on-disk cache at ~/.cache/kiln/inductor unless the user chose a
    directory (TORCHINDUCTOR_CACHE_DIR). Importing torch._dynamo writes inductor's /tmp default
    into the environment, so that value counts as "not chosen"."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        base = Path(os.environ.get("KILN_CACHE_DIR") or Path.home() / ".cache" / "kiln")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(base / "inductor")


def _call_layer(layer: torch.nn.Module, *args: torch.Tensor) -> torch.Tensor:
    return layer(*args)


_layer_calls = itertools.count()


def fresh_layer_call() -> Callable[..., torch.Tensor]:
    """`_call_layer` with a code object of its own. Dynamo keeps one cache of compiled graphs
    per code object: runners sharing one (several models in a process: tests, benchmarks) would
    pile their buckets into it, hit its recompile limit and silently run eager."""
    code = _call_layer.__code__.replace(co_name=f"_call_layer_{next(_layer_calls)}")
    return types.FunctionType(code, _call_layer.__globals__, code.co_name)
