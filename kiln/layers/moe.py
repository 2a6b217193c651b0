"""Mixture of experts: a router picks each token's experts, then each active expert runs once.

    route:   logits = x @ W_gate^T           (fp32: near-ties between experts decide routing)
             weights, ids = softmax_topk(...) | grouped_topk(...)     kiln/layers/router.py
    experts: the step's (token, expert) pairs are sorted by expert, and each expert that got rows
             runs one SwiGLU over all of them (vLLM's fused_moe and llama.cpp's mul_mat_id do the
             same); the outputs, scaled by their weights, are added back to their tokens.

A decode step therefore reads only the selected experts' weights, and a prefill chunk runs each
expert as one matrix product over its rows, never a loop over tokens.

Expert weights are stacked per layer as GGUF stores them: `gate_up_proj` [E, 2I, H] (gate rows,
then up rows) and `down_proj` [E, H, I]. The loader fills them per expert (Hugging Face's
`experts.N.gate_proj.weight`, Mixtral's `w1/w3/w2`) or whole (GGUF's `ffn_*_exps`, a
transformers-5 fused tensor). With --quantization, `quantize` turns each expert into kiln's
Int4Linear/Int8Linear modules (kiln/layers/quant/linear.py), so experts run the same kernels as dense
layers; GGUF 4-bit blocks reach them without a dense copy (`stash_quantized`). Where kiln's
CPU kernels run (x86, AVX2 or better) int4 experts stay stacked instead, packed for
`kernels.ops.moe_q4`, which runs all of a step's routed experts in one call
(`expert_weights(e)` gives any form's dense weights back, for tests). `select` takes a pool of a
layer's experts for kiln/layers/moe_pools.py, which splits layers between devices.

Routing is counted (`tokens_per_expert`, per layer) for /metrics and the benchmark report.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers.eager import eager_only

# --------------------------------------------------------------------------- experts


class Experts(nn.Module):
    """E SwiGLU experts of one layer, stacked; `forward(x, weights, ids)` runs the routed rows."""

    # The loader may stash GGUF Q4_0/Q4_1 expert tensors as their raw blocks (GGUFBlocks),
    # which _quantize_stacked_q4 packs into the tiles without unpacking a code.
    takes_q4_blocks = True

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 layer: int = 0) -> None:
        super().__init__()
        self.layer = layer  # the decoder layer's index, for the routing statistics
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        e, h, i = num_experts, hidden_size, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        # (part, expert or None for all) -> GroupQuant, until `quantize` applies them
        self.stash: dict[tuple[str, int | None], Any] = {}
        # Set by `quantize`: per expert, a module for gate_up and one for down.
        self.quantized: nn.ModuleList | None = None
        # Or, with kiln's CPU kernels (int4): all experts stacked in reference.pack_q4's
        # layout, w13 [E, 2I/8, H/32, 160] and w2 [E, H/8, I/32, 160], run by one moe_q4 call.
        self.register_buffer("w13_q4", None)
        self.register_buffer("w2_q4", None)
        # Tokens routed to each expert since startup (cumulative; read by /metrics). Always on
        # the CPU (explicitly: the model is built under a meta-device context).
        self.tokens_per_expert = torch.zeros(e, dtype=torch.int64, device="cpu")
        # False for a pool of a SplitExperts, which counts for the whole layer in global ids.
        self.counts_routing = True
        # Shared experts absorbed into the stack (`absorb_shared`): w13_q4 / w2_q4 hold them
        # as this many virtual experts after the E routed ones, run by every token.
        self.num_shared = 0
        # Slots the stacked layout keeps after the E routed experts for a shared expert the
        # block may hand over (its MoE block sets it): absorbed in place, not by a copy of the
        # whole stack (8.6 GB on the full-size benchmark model). Unused where none comes.
        self.reserve_shared = 0
        self._spare: tuple[torch.Tensor, torch.Tensor] | None = None
        # Where the stacked tiles are kept between runs (kiln/layers/tile_cache.py; set by the
        # loader, None: packed at every start), and whether this run's came from there.
        self.tile_cache: Any = None
        self.from_tile_cache = False
        # OpenMP threads of the moe_q4 call; 0: torch's count. A SplitExperts pool on the CPU
        # takes its share, so two pools running at once do not oversubscribe the cores (their
        # teams spin at barriers: 3 threads on 2 cores cost more than they give).
        self.threads = 0

    # ------------------------------------------------------------------ loading

    def _rows(self, part: str) -> tuple[nn.Parameter, int, int]:
        """(stacked parameter, first row, rows) of one part in every expert."""
        i = self.intermediate_size
        return {"gate": (self.gate_up_proj, 0, i), "up": (self.gate_up_proj, i, i),
                "gate_up": (self.gate_up_proj, 0, 2 * i),
                "down": (self.down_proj, 0, self.hidden_size)}[part]

    def parts_loaded(self, part: str, expert: int | None) -> list[str]:
        """The completeness keys a load of (part, expert) covers: "gate:3", "down:0", ..."""
        names = ("gate", "up") if part == "gate_up" else (part,)
        experts = range(self.num_experts) if expert is None else (expert,)
        return [f"{n}:{e}" for n in names for e in experts]

    def expected_parts(self) -> set[str]:
        return {f"{n}:{e}" for n in ("gate", "up", "down") for e in range(self.num_experts)}

    def load(self, part: str, expert: int | None, tensor: torch.Tensor) -> None:
        """Copies one expert's part ([rows, in]) or all experts' ([E, rows, in] or, as GGUF
        hands it, [E * rows, in]) into the stacked weights."""
        param, start, size = self._rows(part)
        dst = param.data[:, start:start + size] if expert is None else \
            param.data[expert, start:start + size]
        if expert is None and tensor.dim() == 2:
            tensor = tensor.view(self.num_experts, -1, tensor.shape[-1])
        if tuple(dst.shape) != tuple(tensor.shape):
            from kiln.errors import ModelLoadError

            raise ModelLoadError(f"expert tensor {part} has shape {tuple(tensor.shape)}, "
                                 f"the model expects {tuple(dst.shape)}")
        dst.copy_(tensor.to(dst.dtype))

    def stash_quantized(self, part: str, expert: int | None, gq: Any) -> None:
        """Keeps 4-bit GGUF blocks (a GroupQuant, or Q4_0/Q4_1 GGUFBlocks, of [E * rows, in] or
        one expert's [rows, in]; part "gate", "up" or "down": GGUF has no fused gate_up) for
        `quantize`, which repacks them as they are."""
        _, _, size = self._rows(part)
        n = size * (self.num_experts if expert is None else 1)
        in_features = self.down_proj.shape[2] if part == "down" else self.hidden_size
        if tuple(gq.shape) != (n, in_features):
            from kiln.errors import ModelLoadError

            raise ModelLoadError(f"expert blocks {part} have shape {tuple(gq.shape)}, "
                                 f"the model expects {(n, in_features)}")
        self.stash[(part, expert)] = gq

    def _expert_groups(self, part: str, e: int) -> Any:
        """Expert e's stashed blocks for `part`, or None where they were loaded dense."""
        from kiln.layers.kernels.formats import GGUFBlocks, GroupQuant

        _, _, size = self._rows(part)
        if (part, e) in self.stash:
            whole, sl = self.stash[(part, e)], slice(None)
        else:
            whole, sl = self.stash.get((part, None)), slice(e * size, (e + 1) * size)
        if whole is None:
            return None
        if isinstance(whole, GGUFBlocks):  # the file's Q4_0/Q4_1 rows: codes unpacked here
            return GGUFBlocks(whole.raw[sl], whole.type_name, whole.in_features).groups()
        return GroupQuant(whole.q[sl], whole.scale[sl], whole.min[sl], whole.group_size)

    def materialize_stash(self) -> None:
        """Writes stashed 4-bit blocks into the dense stacked weights (no quantization pass)."""
        with torch.no_grad():
            for e in range(self.num_experts):
                self._materialize_expert(e)
        self.stash = {}

    # ------------------------------------------------------------------ quantization

    def quantize(self, mode: str, use_kernels: bool = True) -> None:
        """Each expert's gate_up and down become kiln's quantized linears (int4 groups of 32,
        or int8 rows); the stacked dense weights are dropped. GGUF 4-bit blocks are repacked
        as they are; anything loaded dense is quantized here. int4 where kiln's CPU kernels run
        (choose_linear_kernel gives q4): all experts stay stacked, packed for moe_q4, which
        runs a step's active experts in one call (threads over experts x row tiles, each
        token's row quantized to int8 once) instead of two module calls per active expert."""
        from kiln.layers.kernels.choose import choose_linear_kernel
        from kiln.layers.quant.linear import Int4Linear, Int8Linear

        dtype = self.gate_up_proj.dtype
        h, i = self.hidden_size, self.intermediate_size
        if mode == "int4" and i % 32 == 0 and choose_linear_kernel(
                "int4", self.gate_up_proj.device, 2 * i, h, use_kernels=use_kernels).kernel == "q4":
            self._quantize_stacked_q4()
            return
        mods: list[nn.Module] = []
        with torch.no_grad():
            for e in range(self.num_experts):
                for part, param in (("gate_up", self.gate_up_proj), ("down", self.down_proj)):
                    w = param.data[e]
                    if mode == "int4" and w.shape[1] % 32 == 0:
                        gq = self._expert_int4(e, part)
                        mods.append(Int4Linear(gq, None, dtype, use_kernels))
                    else:
                        self._materialize_expert(e)
                        mods.append(Int8Linear.from_float(w.float(), None, dtype, use_kernels))
        self.quantized = nn.ModuleList(mods)
        self._drop_dense()

    def _expert_int4(self, e: int, part: str) -> Any:
        """Expert e's `part` ("gate_up" or "down") as a GroupQuant: stashed GGUF blocks as they
        are, dense rows quantized here."""
        from kiln.layers.kernels.formats import GroupQuant
        from kiln.layers.quant.linear import quantize_int4_groups

        w = (self.gate_up_proj if part == "gate_up" else self.down_proj).data[e]
        pieces = []
        names = ("gate", "up") if part == "gate_up" else ("down",)
        with torch.no_grad():
            for name in names:
                gq = self._expert_groups(name, e)
                if gq is None:
                    _, start, size = self._rows(name)
                    gq = quantize_int4_groups(w[start:start + size])
                pieces.append(gq)
        return GroupQuant.cat(pieces)

    def _quantize_stacked_q4(self) -> None:
        """All experts into the kernels' stacked layout (see w13_q4), written in place. A part
        whose GGUF Q4_0/Q4_1 blocks came whole (`*_exps`) is packed in one call from the
        file's bytes (ops.pack_q4_blocks: no code unpacked); otherwise one expert at a
        time (a whole layer's codes are never held unpacked)."""
        from kiln.layers.kernels import ops, reference
        from kiln.layers.kernels.formats import GGUFBlocks
        from kiln.layers.quant.linear import quantize_int4_groups
        from kiln.layers.tile_cache import empty_on_huge_pages

        n, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        tile = reference.Q4_TILE
        r = n + self.reserve_shared
        # Blocks without mins where every part is whole GGUF Q4_0: 10% fewer bytes a step reads
        # (reference.Q4_SYM_BLOCK), the same bits (a shared expert joins in the stack's blocks:
        # absorb_shared)
        sym = all(
            isinstance(b, GGUFBlocks) and b.type_name == "Q4_0"
            for b in (self.stash.get((part, None)) for part in ("gate", "up", "down")))
        block = reference.Q4_SYM_BLOCK if sym else reference.Q4_BLOCK
        shapes = ((r, 2 * i // tile, h // 32, block), (r, -(-h // tile), i // 32, block))
        cached = self.tile_cache.load(self.layer, *shapes) if self.tile_cache else None
        # (packed where they will stay: on 2 MiB pages, which weights_on_huge_pages then
        # leaves as they are)
        w13, w2 = cached or (empty_on_huge_pages(shapes[0]), empty_on_huge_pages(shapes[1]))
        # gate rows, then up rows: I % 32 == 0 here, so each part fills whole tiles
        with torch.no_grad():
            for part, out in () if cached else (
                    ("gate", w13[:n, :i // tile]), ("up", w13[:n, i // tile:]), ("down", w2[:n])):
                whole = self.stash.get((part, None))
                if isinstance(whole, GGUFBlocks):
                    ops.pack_q4_blocks(whole.raw.view(n, -1, whole.raw.shape[1]),
                                       whole.type_name, whole.in_features, out=out)
                    continue
                param, start, size = self._rows(part)
                for e in range(n):
                    gq = self._expert_groups(part, e)
                    if gq is None:
                        gq = quantize_int4_groups(param.data[e, start:start + size])
                    reference.pack_q4(gq.q, gq.scale, gq.min, out=out[e])
        # w13_q4 / w2_q4 are the first n of the stack; the reserved rows stay untouched (not
        # resident) until absorb_shared fills them (a cached stack has them filled already)
        self.from_tile_cache = cached is not None
        self._spare = (w13, w2) if self.reserve_shared else None
        self.w13_q4, self.w2_q4 = w13[:n], w2[:n]
        self._drop_dense()

    def keep_slots_for_shared(self, width: int) -> None:
        """A shared expert `width` wide comes later (absorb_shared): keep its virtual experts'
        rows free in the stacked layout, where the routed width divides its own."""
        i = self.intermediate_size
        self.reserve_shared = width // i if i and width % i == 0 else 0

    def absorb_shared(self, gate_up: nn.Module, down: nn.Module) -> bool:
        """Takes a shared expert (a SwiGLU every token runs: Qwen2-MoE's `shared_expert`,
        DeepSeek's `shared_experts`) into the stack as S = I_s / I virtual experts of the
        routed ones' width, so that one moe_q4 call runs routed and shared rows together: one
        parallel region instead of three more ops, the shared weights streamed beside the
        routed ones. Virtual expert c is the shared gate/up rows [cI, (c+1)I) and the down
        columns [cI, (c+1)I): its outputs add up to the shared expert's (a sum split in S
        parts; the tiles are sliced, not re-quantized). Only where both are kiln's int4 tiles
        without bias and I divides I_s; returns whether it did."""
        from kiln.layers.kernels import reference
        from kiln.layers.quant.linear import Int4Linear

        i, h = self.intermediate_size, self.hidden_size
        ok = (self.w13_q4 is not None and self.num_shared == 0
              and all(isinstance(m, Int4Linear) and m.kernel == "q4" and m.bias is None
                      for m in (gate_up, down))
              and gate_up.in_features == h and down.out_features == h
              and gate_up.out_features == 2 * down.in_features
              and down.in_features % i == 0)
        if not ok:
            return False
        n_s = down.in_features // i
        tiles, groups = i // 8, i // 32  # one expert's gate rows in tiles, down cols in groups
        # [2 I_s / 8, H/32, B], [H/8, I_s/32, B] in the stack's blocks B (with mins or not)
        block = self.w13_q4.shape[-1]
        gu = reference.as_block(gate_up.packed, gate_up.out_features, block)
        dn = reference.as_block(down.packed, down.out_features, block)
        if gu is None or dn is None:
            return False
        up0 = n_s * tiles
        e = self.num_experts
        spare = self._spare
        if spare is not None and spare[0].shape[0] >= e + n_s and \
                spare[0].data_ptr() == self.w13_q4.data_ptr():  # the rows kept for it
            w13, w2 = spare[0][:e + n_s], spare[1][:e + n_s]
        else:  # none kept (or the stack moved since): a copy of the stack
            w13 = torch.cat([self.w13_q4, self.w13_q4.new_empty((n_s, *self.w13_q4.shape[1:]))])
            w2 = torch.cat([self.w2_q4, self.w2_q4.new_empty((n_s, *self.w2_q4.shape[1:]))])
        with torch.no_grad():
            for c in range(n_s):
                for dst, src in ((w13[e + c, :tiles], gu[c * tiles:(c + 1) * tiles]),
                                 (w13[e + c, tiles:], gu[up0 + c * tiles:up0 + (c + 1) * tiles]),
                                 (w2[e + c], dn[:, c * groups:(c + 1) * groups])):
                    # a stack mapped from the tile cache has these rows already: a write
                    # would copy its pages out of the page cache for nothing
                    if not (self.from_tile_cache and torch.equal(dst, src)):
                        dst.copy_(src)
        self.w13_q4, self.w2_q4, self._spare = w13, w2, None
        self.num_shared = n_s
        return True

    def tile_stacks(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The whole stacked layout (w13, w2 with the rows kept for a shared expert), as the
        tile cache stores it; None where the experts are not stacked int4 tiles."""
        if self.w13_q4 is None:
            return None
        w13, w2 = self._spare or (self.w13_q4, self.w2_q4)
        return (w13, w2) if w13.shape[0] == self.num_experts + self.reserve_shared else None

    def expert_weights(self, e: int, dtype: torch.dtype = torch.float32
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) weights, dense, whatever the form they run
        in (dequantized where quantized): for tests and inspection."""
        from kiln.layers.kernels import reference
        from kiln.layers.kernels.formats import GroupQuant

        if self.w13_q4 is not None:
            i, h = self.intermediate_size, self.hidden_size
            return (GroupQuant(*reference.unpack_q4(self.w13_q4[e], 2 * i)).dequantize(dtype),
                    GroupQuant(*reference.unpack_q4(self.w2_q4[e], h)).dequantize(dtype))
        if self.quantized is not None:
            return (self.quantized[2 * e].dequantize(dtype),
                    self.quantized[2 * e + 1].dequantize(dtype))
        return self.gate_up_proj[e].to(dtype), self.down_proj[e].to(dtype)

    @property
    def is_quantized(self) -> bool:
        return self.quantized is not None or self.w13_q4 is not None

    def _drop_dense(self, dtype: torch.dtype | None = None) -> None:
        dtype = dtype or self.gate_up_proj.dtype
        self.stash = {}
        # The stacked dense weights are not needed any more: empty placeholders keep the
        # parameter names (and nothing else) for code that lists them.
        self.gate_up_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(0, dtype=dtype), requires_grad=False)

    def _materialize_expert(self, e: int) -> None:
        for part in ("gate", "up", "down"):
            gq = self._expert_groups(part, e)
            if gq is not None:
                param, start, size = self._rows(part)
                param.data[e, start:start + size].copy_(gq.dequantize(param.dtype))

    # ------------------------------------------------------------------ placement

    def select(self, expert_ids: list[int], device: torch.device | str) -> Experts:
        """A pool of this layer's experts `expert_ids` (in that order: local id i is global
        expert_ids[i]), in whatever form they run here, on `device`. The kernels' packed
        int4 runs only on the CPU: moved to another device, those experts become Int4Linear
        modules there. The pool does not count routing (its SplitExperts does)."""
        from kiln.layers.kernels.formats import GroupQuant
        from kiln.layers.quant.linear import Int4Linear

        assert not self.num_shared, "experts with an absorbed shared expert are not split"
        device = torch.device(device)
        dtype = self.gate_up_proj.dtype
        with torch.device("meta"):
            pool = Experts(len(expert_ids), self.hidden_size, self.intermediate_size, self.layer)
        pool.counts_routing = False
        pool.tokens_per_expert = torch.zeros(0, dtype=torch.int64)
        idx = torch.tensor(expert_ids, dtype=torch.long)
        whole = list(expert_ids) == list(range(self.num_experts))
        with torch.no_grad():
            if self.w13_q4 is not None and device.type == "cpu" and whole:
                pool.w13_q4, pool.w2_q4 = self.w13_q4, self.w2_q4  # shared, not copied
            elif self.w13_q4 is not None and device.type == "cpu":
                pool.w13_q4 = self.w13_q4.index_select(0, idx).contiguous()
                pool.w2_q4 = self.w2_q4.index_select(0, idx).contiguous()
            elif self.w13_q4 is not None:
                from kiln.layers.kernels import reference

                i, h = self.intermediate_size, self.hidden_size
                mods: list[nn.Module] = []
                for e in expert_ids:
                    for packed, rows in ((self.w13_q4[e], 2 * i), (self.w2_q4[e], h)):
                        q, scale, mn = reference.unpack_q4(packed, rows)
                        gq = GroupQuant(q.to(device), scale.to(device), mn.to(device), 32)
                        mods.append(Int4Linear(gq, None, dtype, False))
                pool.quantized = nn.ModuleList(mods)
            elif self.quantized is not None:
                pool.quantized = nn.ModuleList(
                    [self.quantized[2 * e + j] for e in expert_ids for j in (0, 1)]).to(device)
            else:
                pool.gate_up_proj = nn.Parameter(
                    self.gate_up_proj.data.index_select(0, idx.to(self.gate_up_proj.device))
                    .to(device), requires_grad=False)
                pool.down_proj = nn.Parameter(
                    self.down_proj.data.index_select(0, idx.to(self.down_proj.device))
                    .to(device), requires_grad=False)
                return pool
        pool._drop_dense(dtype)
        return pool

    def storage_bytes(self) -> int:
        """Bytes the experts' weights take, in the form they run in."""
        tensors = [*self.parameters(), *self.buffers()]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ------------------------------------------------------------------ running

    @eager_only  # data-dependent: which experts run depends on the routing
    def count(self, ids: torch.Tensor) -> None:
        """Adds a step's routing (ids [T, k]) to the counters /metrics reads (a pool of a
        SplitExperts counts nothing: the layer counts in global ids)."""
        if self.counts_routing:
            self.tokens_per_expert += torch.bincount(ids.reshape(-1),
                                                     minlength=self.num_experts).cpu()

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                shared_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k] from a router. Returns sum_j weights[t, j] *
        expert_{ids[t, j]}(x[t]) for every token t, [T, H] in x's dtype. An id of -1 skips its
        pair: SplitExperts hands each pool the ids of its own experts only. With shared experts
        absorbed, every token also runs them, scaled by `shared_weight` [T, 1] (None: 1): the
        pairs (t, E + c) follow the routed ones (what moe_layer appends too)."""
        if self.w13_q4 is not None:
            self.count(ids)
            if self.num_shared:
                ids, weights = with_shared_pairs(ids, weights, self.num_experts,
                                                 self.num_shared, shared_weight)
            return _moe_q4(x, weights, ids, self.w13_q4, self.w2_q4, self.threads)
        k = ids.shape[1]
        flat = ids.reshape(-1)
        wflat = weights.reshape(-1)
        pair = None  # pair index (token * k + j) of each entry of flat; None: all of them
        if not self.counts_routing and bool((flat < 0).any()):
            pair = (flat >= 0).nonzero().squeeze(1)
            flat, wflat = flat[pair], wflat[pair]
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts)
        counts_cpu = counts.cpu()
        if self.counts_routing:
            self.tokens_per_expert += counts_cpu
        token_of = (order if pair is None else pair[order]) // k
        xs = x.index_select(0, token_of)  # [pairs, H], grouped by expert
        i = self.intermediate_size
        if self.quantized is None and _grouped_mm_ok(xs):
            # Dense experts: all of them in one grouped GEMM per projection (each expert's rows
            # end at offs[e]), no loop and no host sync for the shapes.
            offs = counts.cumsum(0).to(torch.int32)
            gu = torch._grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs)
            out = torch._grouped_mm(F.silu(gu[:, :i]) * gu[:, i:],
                                    self.down_proj.transpose(1, 2), offs=offs)
            out = out * wflat[order].to(out.dtype).unsqueeze(1)
            return torch.zeros_like(x).index_add_(0, token_of, out)
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts_cpu.tolist()):
            if n == 0:
                continue
            rows = xs[start:start + n]
            if self.quantized is not None:
                gu = self.quantized[2 * e](rows)
                out[start:start + n] = self.quantized[2 * e + 1](F.silu(gu[:, :i]) * gu[:, i:])
            else:
                gu = F.linear(rows, self.gate_up_proj[e])
                out[start:start + n] = F.linear(F.silu(gu[:, :i]) * gu[:, i:],
                                                self.down_proj[e])
            start += n
        out = out * wflat[order].to(out.dtype).unsqueeze(1)
        return torch.zeros_like(x).index_add_(0, token_of, out)

    def extra_repr(self) -> str:
        form = ("int4 stacked (moe_q4)" if self.w13_q4 is not None
                else "quantized" if self.quantized is not None else "dense")
        shared = f" + {self.num_shared} shared" if self.num_shared else ""
        return (f"experts={self.num_experts}{shared}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, {form}")


def with_shared_pairs(ids: torch.Tensor, weights: torch.Tensor, num_experts: int, shared: int,
                      shared_weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's routed pairs, then its `shared` virtual shared-expert pairs (ids E..E+S-1,
    weight `shared_weight` [T, 1] or 1): [T, k + S] ids and weights, as moe_layer forms them."""
    t = ids.shape[0]
    sid = torch.arange(num_experts, num_experts + shared, device=ids.device).expand(t, shared)
    sw = (shared_weight.float() if shared_weight is not None
          else torch.ones(t, 1, device=weights.device)).expand(t, shared)
    return torch.cat([ids, sid], dim=1), torch.cat([weights.float(), sw], dim=1)


def fuse_shared_experts(model: nn.Module) -> int:
    """Every MoE block that can takes its shared expert into its stacked experts
    (`fuse_shared_expert`); the number of blocks that did. The runner calls it once after
    loading, where the experts are not split between pools."""
    return sum(bool(m.fuse_shared_expert()) for m in model.modules()
               if hasattr(m, "fuse_shared_expert"))


def _grouped_mm_ok(xs: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM runs these rows: on CPU (float32/bf16, any recent torch),
    and on CUDA for bf16 on Hopper and newer (its kernel's requirement). Elsewhere the experts
    loop, one matmul per active expert. The CUDA branch is written from torch's documented
    constraints and has not been run on a GPU yet."""
    if not hasattr(torch, "_grouped_mm") or xs.dtype not in (torch.float32, torch.bfloat16):
        return False
    if xs.device.type == "cpu":
        return True
    return (xs.device.type == "cuda" and xs.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(xs.device) >= (9, 0))


def _moe_q4(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            w13: torch.Tensor, w2: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """Experts.forward on kiln's kernels: one call for the layer's routed rows."""
    from kiln.layers.kernels import ops

    xa = x if x.dtype in (torch.float32, torch.bfloat16) else x.float()
    y = ops.moe_q4(xa.contiguous(), ids.to(torch.int64), weights.float(), w13, w2, threads)
    return y.to(x.dtype)


# --------------------------------------------------------------------------- routing statistics


def experts_of(model: nn.Module) -> list[Any]:
    """The modules that count each MoE layer's routing (Experts, or moe_pools.SplitExperts where
    the layer is split; not their pools), in layer order ([] for a dense model): found once, so
    reading the counters each step does not walk the module tree."""
    return sorted((m for m in model.modules() if getattr(m, "counts_routing", False)),
                  key=lambda m: m.layer)


def reset_routing_counts(experts: list[Any]) -> None:
    """Zeroes the counters when the engine starts: the tokens of startup's memory-profiling
    prefill went through the routers too, and are no user's."""
    for m in experts:  # in place: LlamaModel's layer stack holds the counters
        m.tokens_per_expert.zero_()


def routing_counts(experts: list[Any]) -> torch.Tensor:
    """A copy of the cumulative tokens per expert, [moe layers, E] int64 (rows in `experts`'
    order): one stack, cheap enough to snapshot after every step for /metrics."""
    if not experts:
        return torch.zeros(0, 0, dtype=torch.int64)
    return torch.stack([m.tokens_per_expert for m in experts])
