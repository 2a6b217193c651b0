"""Python faces of kiln's CPU kernels (the kernel sources beside this file; kquant.cpp's are
in kiln/layers/quant/gguf_blocks.py), at the level kiln.layers.kernels selected (`lib()`:
torch.ops.kiln_<level>).

`q4_linear`: int4 weights in pack_q4's tiles x activations quantized to int8 per group of 32
(llama.cpp's Q4_0 x Q8_0 scheme); `moe_q4`: a whole MoE layer's routed experts in one call;
`heads_q4`: one linear per attention head (MLA); `lora_add`: a linear's LoRA adapters for all of a step's rows in one call (kiln/engine/lora.py);
`attend_rows`: attention row by row in one fixed order (batch-invariant); `q8_linear`: the int8
head; `rms_norm`, `silu_mul`, `rope_write`: the fp32 row kernels; `decode_layer`: a whole Llama
decoder layer of any step (decode rows, prefill chunks, speculative verify rows) in one call,
chaining those kernels in the eager layer's order; `decode_stack`: all of a step's layers.
The layouts they read and what they compute, in PyTorch, are kiln/layers/kernels/reference.py
(pack_q4, q4_reference), which the builder checks each library against.
"""

from __future__ import annotations

import torch

from kiln.layers.kernels import available, lib


def q4_linear(x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] fp32 or bf16 @ W^T, W in pack_q4's layout -> [M, n] in x's dtype. x is
    quantized to int8 per group of 32 inside (llama.cpp's Q8_0): relative error vs the
    dequantized weight in fp32 ~0.5% on random data (q4_reference computes the same rounding)."""
    return lib().q4_linear(x, packed, n)


def lora_add(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             pieces: torch.Tensor, ranks: torch.Tensor, seg: torch.Tensor,
             local: torch.Tensor) -> None:
    """out [M, N] += (x [M, K] @ A_l^T) @ B_l^T over the row ranges of `seg` (int64 [S, 3]:
    adapter slot, first row, end row; `local` int32 [slots] -> l, -1: skip), in place, fp32.
    a [L, R, K], bt [L, R, N] (B transposed), pieces int32 [L, P, 4] (ranks j0..j1 write
    columns lo..hi only), ranks int32 [L]: see lora_add in lora.cpp."""
    lib().lora_add(out, x, a, bt, pieces, ranks, seg, local)


def moe_q4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
           w2: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """One MoE layer's routed experts in one call: x [T, H], ids/weights [T, k] (int64 /
    fp32), w13 [E, 2I/8, H/32, 160] (pack_q4 of each expert's gate rows then up rows,
    stacked), w2 [E, H/8, I/32, 160] -> sum_j weights[t, j] * down(silu(gate x) * up x),
    [T, H] in x's dtype. An id of -1 skips its pair (its expert runs in another pool).
    `threads`: OpenMP threads for this call (0: torch's count)."""
    return lib().moe_q4(x, ids, weights, w13, w2, threads)


def heads_q4(x: torch.Tensor, w: torch.Tensor, n: int) -> torch.Tensor:
    """One linear per head: x [T, H, K] fp32, w [H, N/8, K/32, 160] (pack_q4 of each head's
    [n, K] weight, stacked) -> fp32 [T, H, n], y[t, h] = W_h x[t, h] (MLA's absorbed
    up-projections; x quantized per group of 32 as in q4_linear)."""
    return lib().heads_q4(x, w, n)


def pack_q4_blocks(raw: torch.Tensor, type_name: str, k: int,
                   out: torch.Tensor | None = None, block: int | None = None) -> torch.Tensor:
    """GGUF Q4_0 / Q4_1 rows (raw uint8 [..., N, K/32 * block bytes]) -> pack_q4's tiles
    [..., ceil(N/8), K/32, 160], written into `out` where given (any strides with contiguous
    160-byte blocks): reference.pack_q4_blocks byte for byte, in one threaded pass where the
    kernels run (a load's experts: PyTorch's strided copies of 16-byte pieces are 10x slower).
    `block` 144 (reference.Q4_SYM_BLOCK, Q4_0 only; or `out`'s last dimension): the tiles
    without their mins."""
    from kiln.layers.kernels import reference

    block = block or reference.Q4_BLOCK
    if not available():
        return reference.pack_q4_blocks(raw, type_name, k, out, block)
    *lead, n, row_bytes = raw.shape
    g = k // 32
    if out is None:
        out = torch.empty(*lead, -(-n // reference.Q4_TILE), g, block, dtype=torch.uint8)
    lib().pack_q4_blocks(raw.reshape(-1, n, row_bytes), row_bytes // g,
                         out.view(-1, *out.shape[-3:]) if lead else out.unsqueeze(0))
    return out


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, table: torch.Tensor,
                row_of: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Batch-invariant attention over the pool (attention.cpp): query row t (q [T, Hq,
    D] fp32) attends to the first lens[t] slots of table[row_of[t]] (k [S, Hk, D], v [S, Hk,
    Dv], fp32, bf16 or fp16, read in place) -> fp32 [T, Hq, Dv]. Each (row, head) is computed
    alone, in an order fixed by its own context length: the same bits whatever else is in the
    step."""
    return lib().attend_rows(q, k, v, table, row_of, lens, scale)


def embed_rows(raw: torch.Tensor, ids: torch.Tensor, type_id: int, dim: int) -> torch.Tensor:
    """Rows `ids` [n] int64 of an embedding kept as GGUF blocks (raw uint8 [V, row bytes] of a
    legacy type: formats.EMBED_ROW_TYPES) -> fp32 [n, dim] (ops.cpp): formats.dequantize_blocks'
    values, bit for bit, in one call instead of ~12 PyTorch ops."""
    return lib().embed_rows(raw, ids, type_id, dim)


def q8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ (w * scale)^T for an int8 weight w [N, K] with one fp32/bf16 scale per
    row -> fp32 [M, N] (attention.cpp): each output one FMA chain over K, the same bits
    whatever the row count (the int8 head under --batch-invariant)."""
    return lib().q8_linear(x, w, scale)


def attend_rows_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          table: torch.Tensor, row_of: torch.Tensor, lens: torch.Tensor,
                          scale: float) -> torch.Tensor:
    """attend_rows in PyTorch, one row at a time (where the kernels are not built; tests):
    every row's ops see only its own context, so it is batch-invariant too, only slower."""
    t_n, hq, _ = q.shape
    hk = k.shape[1]
    out = q.new_empty((t_n, hq, v.shape[-1]), dtype=torch.float32)
    for t in range(t_n):
        slots = table[int(row_of[t]), : int(lens[t])]
        kt = k.index_select(0, slots).float().repeat_interleave(hq // hk, dim=1)  # [n, Hq, D]
        vt = v.index_select(0, slots).float().repeat_interleave(hq // hk, dim=1)
        s = (kt * q[t].float()).sum(-1) * scale  # [n, Hq]
        out[t] = (torch.softmax(s, dim=0).unsqueeze(-1) * vt).sum(0)
    return out


def decode_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      ln1: torch.Tensor, ln2: torch.Tensor, eps: float,
                      weights: list[torch.Tensor], kinds: list[int], rows: list[int],
                      counts: list[int], biases: list[torch.Tensor | None], k: torch.Tensor,
                      v: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
                      row_of: torch.Tensor, lens: torch.Tensor, num_heads: int,
                      scale: float, lora: list[torch.Tensor] | None = None,
                      lora_seg: torch.Tensor | None = None,
                      qk_norms: tuple[torch.Tensor, torch.Tensor, float] | None = None
                      ) -> torch.Tensor:
    """One Llama decoder layer of a whole step in one call (layers.cpp
    decode_layer): x [T, H] fp32 -> [T, H], the step's K/V written to the fp32 pools k/v at
    `slots`. The four linears (qkv, o, gate_up, down) as `counts` parts each of `weights`:
    kind Q4_KIND (pack_q4's tiles, rows = out features) or GGML type ids (KQuantLinear's parts);
    `biases` per linear or None. table [R, L] / row_of [T] / lens [T]: what each row attends
    to (attend_rows' arguments). `lora` / `lora_seg`: a LoRA step's adapters, 5 tensors per
    linear (engine/lora.py's stacked a, bt, pieces, ranks, local; empty a: none on it) and the
    step's row groups, added after each linear by lora_add as the modules' hooks add them.
    `qk_norms`: Qwen3's per-head (q_norm, k_norm, eps), applied to the qkv before RoPE. The
    same kernels in the same order as the layer's eager forward: the same bits."""
    qn, kn, qk_eps = qk_norms if qk_norms is not None else (None, None, 0.0)
    return lib().decode_layer(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases,
                              k, v, slots, table, row_of, lens, num_heads, scale, lora or [],
                              lora_seg, qn, kn, qk_eps)


def softmax_topk(logits: torch.Tensor, k: int, renormalize: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """kiln/layers/router.py's softmax_topk (fp32 logits [T, E] -> weights fp32 [T, k], ids int64
    [T, k]) with the routing the one-call MoE layers run (moe.cpp route_row): eager and one-call
    layers pick the same experts with the same weights, bit for bit."""
    return lib().softmax_topk(logits, k, renormalize)


def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A router's fp32 logits x [T, H] @ w [E, H]^T, each one FMA chain (kernels.h
    router_logit): a row's logits do not depend on the step's other rows (batch-invariant
    routing)."""
    return lib().router_logits(x, w)


def moe_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ln1: torch.Tensor,
              ln2: torch.Tensor, eps: float, weights: list[torch.Tensor], kinds: list[int],
              rows: list[int], counts: list[int], biases: list[torch.Tensor | None],
              q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, qk_eps: float,
              k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, table: torch.Tensor,
              row_of: torch.Tensor, lens: torch.Tensor, num_heads: int, scale: float,
              router: torch.Tensor, top_k: int, renormalize: bool, w13: torch.Tensor,
              w2: torch.Tensor, shared: int = 0, shared_gate: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """A mixture-of-experts decoder layer of a whole step in one call (layers.cpp
    moe_layer): decode_layer's attention (two linears: qkv, o; Qwen3's per-head q/k norms
    where given), then the router's fp32 logits (router [E, H]), softmax + top-k
    (renormalized), and moe_q4 over the stacked experts w13 / w2; with `shared` virtual
    experts after the E routed ones (an absorbed shared expert), every token runs them too,
    weighted sigmoid of the router's row E (`shared_gate`, router [E + 1, H]) or 1. Returns (x out [T, H], ids
    [T, top_k]: the routing, for the experts' counters). The same kernels in the same order as
    the layer's eager forward."""
    return lib().moe_layer(x, cos, sin, ln1, ln2, eps, weights, kinds, rows, counts, biases,
                           q_norm, k_norm, qk_eps, k, v, slots, table, row_of, lens, num_heads,
                           scale, router, top_k, renormalize, w13, w2, shared, shared_gate)


def _script_object(name: str) -> torch.ScriptObject:
    """A new instance of the selected library's C++ class `name` (torch.classes.kiln_<level>)."""
    from kiln.layers.kernels import level

    return getattr(getattr(torch.classes, f"kiln_{level()}"), name)()


def layer_stack() -> torch.ScriptObject:
    """An empty LayerStack (layers.cpp): `add(ln1, ln2, eps, weights, kinds, rows,
    counts, biases, k, v, num_heads, scale, q_norm, k_norm, qk_eps)` appends a layer as
    decode_layer takes it, `add_moe(<the same>, router, top_k, renormalize, w13, w2, routed,
    shared, shared_gate)`
    one as moe_layer does, whose routing decode_stack adds to `routed` [E] int64 (biases, q/k
    norms: an empty tensor where none)."""
    return _script_object("LayerStack")


def decode_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 stack: torch.ScriptObject, slots: torch.Tensor, table: torch.Tensor,
                 row_of: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Every layer of `stack` on x [T, H], in one call: decode_layer's / moe_layer's result
    layer after layer, bit for bit, without LoRA (eager only: the pools and the routing
    counters are written in place)."""
    return lib().decode_stack(x, cos, sin, stack, slots, table, row_of, lens)


def mla_layer_object() -> torch.ScriptObject:
    """An empty MlaLayer (mla.cpp): DeepSeek's decoder layer as mla_layer takes it, set by
    `attention(ln1, ln2, eps, q_a_norm, kv_norm, latent_eps, weights, kinds, rows, counts,
    biases, uk, uv, heads, nope, rope, v_dim, interleave, k, v, scale)` and, for a MoE layer,
    `moe(router, bias, top_k, n_group, topk_group, method, sigmoid, renormalize, scale, w13,
    w2, shared, routed)` (empty tensors stand for None)."""
    return _script_object("MlaLayer")


def mla_layer(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: torch.ScriptObject,
              slots: torch.Tensor, table: torch.Tensor, row_of: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
    """A DeepSeek decoder layer (MLA + dense MLP or MoE) of a whole step in one call: x [T, H]
    fp32 -> [T, H]; the step's latent rows written to the layer's pool, its routing added to
    its counters (eager only)."""
    return lib().mla_layer(x, cos, sin, layer, slots, table, row_of, lens)


def mla_stack_object() -> torch.ScriptObject:
    """An empty MlaStack (mla.cpp): `add(layer)` appends an MlaLayer."""
    return _script_object("MlaStack")


def mla_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, stack: torch.ScriptObject,
              slots: torch.Tensor, table: torch.Tensor, row_of: torch.Tensor,
              lens: torch.Tensor) -> torch.Tensor:
    """mla_layer of every layer of `stack` in order, in one call (eager only)."""
    return lib().mla_stack(x, cos, sin, stack, slots, table, row_of, lens)


Q4_KIND = -1  # decode_layer's kind of a pack_q4 weight


# --------------------------------------------------------------------------- row kernels
# rms_norm / silu_mul / rope_write: fp32 rows (the KV pools of rope_write fp32 or fp16).


def rope_write(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, slots: torch.Tensor, num_heads: int) -> torch.Tensor:
    """A step's RoPE and K/V write in one pass: qkv [T, (Hq + 2 Hk) * D] fp32, cos and signed
    sin [T, 1, D] (RotaryEmbedding.lookup); k and v rotated/stored at `slots` [T] of the pools
    [S, Hk, D] (fp32 or fp16). Returns the rotated q [T, Hq, D]."""
    return lib().rope_write(qkv, cos, sin, k, v, slots, num_heads)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [M, H] fp32 with weight [H] in one pass (kiln.layers.norm's math)."""
    return lib().rms_norm(x, weight, eps)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """silu(g) * u for gu = [g u], [M, 2 I] fp32 -> [M, I], in one pass."""
    return lib().silu_mul(gu)


def elementwise_kernels_ok(dtype: torch.dtype) -> bool:
    """Whether rms_norm / silu_mul / rope_write run for a model computing in `dtype` here."""
    return dtype == torch.float32 and available()


def use_elementwise_kernels(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Lets the modules of a CPU model that have an `elementwise_kernel` flag (RMSNorm,
    LlamaMLP, LlamaAttention) run rms_norm / silu_mul / rope_write in their eager steps, where
    the kernels for the model's dtype run here."""
    if not elementwise_kernels_ok(dtype):
        return
    for m in model.modules():
        if getattr(m, "elementwise_kernel", None) is False:
            m.elementwise_kernel = True
