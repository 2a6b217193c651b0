"""Llama-family decoder: Llama, SmolLM, Mistral (sliding window), Qwen2 (qkv bias), Qwen3
(per-head q/k RMSNorm), Phi-3/Phi-4 (fused qkv and gate_up checkpoints, partial RoPE, sliding
window) and Granite (embedding/residual/attention/logit multipliers): one decoder, switched by
ModelConfig's fields. Gemma 2/3 and OLMo 2 reuse its attention and MLP with their own layers
(kiln/models/gemma.py, olmo2.py).

Attribute names mirror the Hugging Face checkpoint (`model.layers.N.self_attn...`), except that
q/k/v and gate/up are packed (`PACKED` tells the loader where each checkpoint tensor goes).
`forward(input_ids, positions)` takes the whole step flattened to one dimension; paged attention
reads its metadata from the per-step context. Logits are computed only for the rows asked for,
by `lm_head`, which is always a module (`TiedLMHead` over the embedding when the checkpoint ties
them), so quantization can swap it like any other linear layer.

Numerics follow transformers: RMSNorm in fp32 then cast back, residual adds and RoPE in the
activation dtype with cos/sin cast to it. In fp32 that is transformers' arithmetic; in bf16 the
same casts happen in the same places.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kiln.layers import lora
from kiln.layers.attention import Attention, get_context
from kiln.layers.kernels import ops
from kiln.layers.linear import Linear, MergedLinear, TiedLMHead
from kiln.layers.norm import RMSNorm
from kiln.layers.rotary import RotaryEmbedding, apply_rotary
from kiln.models.config import ModelConfig

# checkpoint module name -> (our packed module, shard name)
PACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}

# How the runner may call a decoder layer: (layer, cos, sin, x) -> x.
LayerCall = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# The layer kernel (--batch-invariant) computes each row as the eager layers do, at any row
# count: it runs every step (decode rows, prefill chunks, verify rows).
DECODE_KERNEL_ANY_ROWS = 1 << 30


# The MLP's gate activations (HF's hidden_act names).
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, layer: int = 0) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(
            cfg.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Per head (Qwen3, Gemma 3), or over the whole projection before the heads are split
        # (OLMo 2).
        self.qk_norm_full = cfg.qk_norm_full
        if cfg.qk_norm:
            q_dim, k_dim = ((self.q_size, self.kv_size) if cfg.qk_norm_full
                            else (self.head_dim, self.head_dim))
            norm_kw = {"offset": cfg.norm_offset, "weight_in_float": cfg.norm_layout != "pre"}
            self.q_norm = RMSNorm(q_dim, cfg.rms_norm_eps, **norm_kw)
            self.k_norm = RMSNorm(k_dim, cfg.rms_norm_eps, **norm_kw)
        self.qk_norm = cfg.qk_norm
        self.rotary = rotary  # shared by all layers; not a child module's parameter
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim,
                              scale=cfg.attention_scale, sliding_window=cfg.layer_window(layer),
                              softcap=cfg.attn_logit_softcapping)
        self.elementwise_kernel = False  # see RMSNorm.elementwise_kernel

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """cos, sin: [T, 1, rotary_dim] from `RotaryEmbedding.lookup` (sin signed)."""
        qkv = self.qkv_proj(x)
        kv = self.attn.kv
        if (self.elementwise_kernel and (not self.qk_norm or self.kernel_qk_norm())
                and kv is not None
                and self.rotary_dim == self.head_dim and self.head_dim % 16 == 0
                and kv.invariant and qkv.dtype == torch.float32
                and kv.k.dtype in (torch.float32, torch.float16)
                and not torch.compiler.is_compiling()):
            if self.qk_norm:
                self._norm_heads(qkv)
            return self.o_proj(self.attn(self.attn.rope_write(qkv, cos, sin), None, None))
        t = qkv.shape[0]
        hq, hk, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, self.q_size + self.kv_size:].view(t, hk, d)
        if self.qk_norm:
            q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
            if self.qk_norm_full:
                q, k = self.q_norm(q).view(t, hq, d), self.k_norm(k).view(t, hk, d)
            else:
                q, k = self.q_norm(q.view(t, hq, d)), self.k_norm(k.view(t, hk, d))
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        else:
            # q and k rotated in one pass: the rotation is per head.
            qk = self._rotate(qkv[:, :self.q_size + self.kv_size].view(t, hq + hk, d), cos, sin)
            q, k = qk[:, :hq], qk[:, hq:]
        return self.o_proj(self.attn(q, k, v))

    def kernel_qk_norm(self) -> bool:
        """Whether the q/k norms run as the kernels run them (per head, Llama-form RMSNorm on
        the kernel, fp32): `_norm_heads`, which moe_layer's qk_norm_rows repeats bit for bit."""
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        return (bool(norms) and not self.qk_norm_full
                and all(n.elementwise_kernel and n.weight.dtype == torch.float32 for n in norms))

    def qk_norms(self) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """(q_norm weight, k_norm weight, eps) as the layer kernels take them; None: none."""
        if not self.qk_norm:
            return None
        return self.q_norm.weight, self.k_norm.weight, self.q_norm.eps

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """Qwen3's per-head q/k RMSNorm on a fused qkv [T, (Hq + 2 Hk) * D], in place, each
        head one row of kiln's rms_norm kernel (layers.cpp qk_norm_rows makes the same calls)."""
        t, hq, hk, d = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        heads = qkv.view(t, hq + 2 * hk, d)
        q, k = heads[:, :hq], heads[:, hq:hq + hk]
        q.copy_(ops.rms_norm(q.reshape(t * hq, d), self.q_norm.weight, self.q_norm.eps)
                .view(t, hq, d))
        k.copy_(ops.rms_norm(k.reshape(t * hk, d), self.k_norm.weight, self.k_norm.eps)
                .view(t, hk, d))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over each head's first `rotary_dim` dims; the rest pass (partial rotary)."""
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rotary(x, cos, sin)
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, intermediate_size: int | None = None) -> None:
        super().__init__()
        i = intermediate_size or cfg.intermediate_size
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {"gate": i, "up": i}, bias=cfg.mlp_bias)
        self.down_proj = Linear(i, cfg.hidden_size, bias=cfg.mlp_bias)
        if cfg.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"MLP activation {cfg.hidden_act!r} is not supported yet")
        self.act = ACTIVATIONS[cfg.hidden_act]
        # see RMSNorm.elementwise_kernel; the kernel is SiLU's only
        self.elementwise_kernel = False if cfg.hidden_act == "silu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if (self.elementwise_kernel and gu.dtype == torch.float32
                and gu.shape[1] % 32 == 0 and not torch.compiler.is_compiling()):
            return self.down_proj(ops.silu_mul(gu))
        i = self.intermediate_size
        return self.down_proj(self.act(gu[:, :i]) * gu[:, i:])


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding,
                 mlp: nn.Module | None = None, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, rotary, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg)  # a MoE block in MoE families
        self.residual_multiplier = cfg.residual_multiplier  # Granite's; 1 elsewhere
        # ops.decode_layer's / ops.moe_layer's arguments (see _layer_args / _moe_args; ()
        # when it cannot run)
        self._layer_args_cache: tuple | None = None
        self._moe_args_cache: tuple | None = None

    def forward(self, cos: torch.Tensor, sin: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        m = self.residual_multiplier
        if m != 1.0:
            x = x + self.self_attn(cos, sin, self.input_layernorm(x)) * m
            return x + self.mlp(self.post_attention_layernorm(x)) * m
        x = x + self.self_attn(cos, sin, self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def decode_kernel_rows(self) -> int:
        """Up to how many rows a step may run this layer as one call of kiln's layer kernel
        (`forward_decode_kernel`); 0 where it cannot: a linear not on kiln's q4 or GGUF-block
        tiles, a pool attend_rows does not read (the kernel runs under --batch-invariant,
        fp32), q/k norms on a dense layer. Any row count where `_layer_args` (a dense Llama
        MLP: decode_layer) or `_moe_args` (a sparse MoE block: moe_layer) finds the eager
        step's own kernels."""
        attn, mlp = self.self_attn, self.mlp
        kv = attn.attn.kv
        if kv is None or not kv.invariant:
            return 0
        # The kernel's layer is Llama's: full RoPE, plain residual adds.
        if attn.rotary_dim != attn.head_dim or self.residual_multiplier != 1.0:
            return 0
        if attn.qk_norm and not attn.kernel_qk_norm():
            return 0
        if isinstance(mlp, LlamaMLP):
            ok = mlp.act is F.silu and self._layer_args() is not None
        else:
            ok = self._moe_args() is not None
        return DECODE_KERNEL_ANY_ROWS if ok else 0

    def forward_decode_kernel(self, cos: torch.Tensor, sin: torch.Tensor,
                              x: torch.Tensor) -> torch.Tensor:
        """`forward` for a whole step as one kernel call (ops.decode_layer): the same kernels
        in the same order, without the ~15 separate ops and their dispatch; each row its own
        context (batch-invariant)."""
        meta = get_context()
        attn = self.self_attn
        kv = attn.attn.kv
        assert kv is not None and kv.invariant
        if not isinstance(self.mlp, LlamaMLP):
            return self._moe_decode_kernel(cos, sin, x)
        args = self._layer_args()
        assert args is not None and meta.step_rows is not None
        adapters = lora.kernel_args([attn.qkv_proj, attn.o_proj, self.mlp.gate_up_proj,
                                     self.mlp.down_proj])
        lora_args = adapters if adapters is not None else (None, None)
        return ops.decode_layer(
            x, cos, sin, self.input_layernorm.weight, self.post_attention_layernorm.weight,
            self.input_layernorm.eps, *args, kv.k, kv.v, meta.slot_mapping,
            *meta.step_rows, attn.num_heads, attn.attn.scale, *lora_args,
            qk_norms=attn.qk_norms())

    def _moe_decode_kernel(self, cos: torch.Tensor, sin: torch.Tensor,
                           x: torch.Tensor) -> torch.Tensor:
        """forward_decode_kernel for a sparse MoE layer: ops.moe_layer, one call (a step with
        LoRA rows runs the eager layer: moe_layer adds no adapters)."""
        if lora.step_active():
            return self.forward(cos, sin, x)
        meta = get_context()
        attn, mlp = self.self_attn, self.mlp
        args = self._moe_args()
        assert args is not None and meta.step_rows is not None
        norms = attn.qk_norms() or (None, None, 0.0)
        out, ids = ops.moe_layer(
            x, cos, sin, self.input_layernorm.weight, self.post_attention_layernorm.weight,
            self.input_layernorm.eps, *args, *norms, attn.attn.kv.k, attn.attn.kv.v,
            meta.slot_mapping, *meta.step_rows, attn.num_heads, attn.attn.scale,
            mlp.gate.weight, mlp.top_k, mlp.renormalize, mlp.experts.w13_q4,
            mlp.experts.w2_q4, mlp.experts.num_shared, mlp.shared_gate_in_router)
        mlp.experts.count(ids)
        return out

    def _moe_args(self) -> tuple | None:
        """ops.moe_layer's (weights, kinds, rows, counts, biases) of the attention's two
        linears, or None where the layer's eager forward does not run exactly the kernels
        moe_layer chains: a SparseMoeBlock (its `moe_layer_kernel` mark) whose shared expert,
        if any, its experts absorbed, all experts stacked for moe_q4, an fp32 router, Llama-form norms and linears on
        kiln's tiles."""
        if self._moe_args_cache is not None:
            return self._moe_args_cache or None
        from kiln.layers.moe import Experts
        from kiln.layers.router import Router

        attn, mlp = self.self_attn, self.mlp
        norms = (self.input_layernorm, self.post_attention_layernorm)
        ok = (getattr(type(mlp), "moe_layer_kernel", False) and mlp.shared_expert is None
              and type(mlp.experts) is Experts and mlp.experts.w13_q4 is not None
              and mlp.experts.counts_routing and isinstance(mlp.gate, Router)
              and mlp.gate.e_score_correction_bias is None
              and mlp.gate.weight.dtype == torch.float32
              and attn.elementwise_kernel
              and all(n.elementwise_kernel and n.weight.dtype == torch.float32 for n in norms)
              and attn.head_dim % 16 == 0 and attn.attn.sliding_window is None
              and attn.attn.kv is not None
              and attn.attn.kv.k.dtype in (torch.float32, torch.float16))
        parts = self._kernel_parts((attn.qkv_proj, attn.o_proj)) if ok else None
        if parts is None:
            self._moe_args_cache = ()
            return None
        self._moe_args_cache = (*parts, [attn.qkv_proj.bias, attn.o_proj.bias])
        return self._moe_args_cache

    @staticmethod
    def _kernel_parts(linears: tuple) -> tuple | None:
        """The linears as the layer kernels take them: (weights, kinds, rows, counts), or None
        where one is not on kiln's q4 or GGUF-block tiles."""
        from kiln.layers.quant.gguf_blocks import KQuantLinear
        from kiln.layers.quant.linear import Int4Linear

        parts: list[tuple[list[torch.Tensor], list[int], list[int]]] = []
        for lin in linears:
            if isinstance(lin, Int4Linear) and lin.kernel == "q4" and lin.dense is None:
                parts.append(([lin.packed], [ops.Q4_KIND], [lin.out_features]))
            elif isinstance(lin, KQuantLinear) and lin.kernel == "gguf":
                parts.append((lin._parts(), list(lin.types), list(lin.rows)))
            else:
                return None
        return ([w for p in parts for w in p[0]], [k for p in parts for k in p[1]],
                [r for p in parts for r in p[2]], [len(p[0]) for p in parts])

    def _layer_args(self) -> tuple | None:
        """ops.decode_layer's (weights, kinds, rows, counts, biases) for this layer, or None
        where its eager fp32 forward does not run exactly the kernels ops.decode_layer chains
        (rms_norm, a q4 / GGUF-block linear + bias, rope_write, attend_rows, silu_mul): the two
        must compute a decode row the same way, bit for bit (--batch-invariant)."""
        if self._layer_args_cache is not None:
            return self._layer_args_cache or None
        attn, mlp = self.self_attn, self.mlp
        if not isinstance(mlp, LlamaMLP):
            self._layer_args_cache = ()
            return None
        norms = (self.input_layernorm, self.post_attention_layernorm)
        hidden = self.input_layernorm.weight.shape[0]
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        ok = (attn.elementwise_kernel and mlp.elementwise_kernel
              and all(n.elementwise_kernel and n.weight.dtype == torch.float32 for n in norms)
              and hidden % 16 == 0 and attn.head_dim % 16 == 0
              and mlp.intermediate_size % 16 == 0
              and attn.attn.sliding_window is None and attn.attn.kv is not None
              and attn.attn.kv.k.dtype in (torch.float32, torch.float16))
        parts = self._kernel_parts(linears) if ok else None
        if parts is None:
            self._layer_args_cache = ()
            return None
        self._layer_args_cache = (*parts, [lin.bias for lin in linears])
        return self._layer_args_cache


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int,
                 make_mlp: Callable[[int], nn.Module | None] | None = None,
                 make_layer: Callable[[int, RotaryEmbedding], nn.Module] | None = None) -> None:
        """`make_mlp(i)`: layer i's MLP (None: dense); `make_layer(i, rotary)`: the whole
        decoder layer, for families whose attention differs (DeepSeek's MLA)."""
        super().__init__()
        # `_weight` skips the random init: on the meta device that init alone imports
        # torch._dynamo (~2 s of startup).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.embed_tokens.weight.requires_grad_(False)
        rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta, max_positions,
                                 cfg.rope_scaling, cfg.max_position_embeddings)
        # Kept outside the layers' module tree: one table for all layers, or (Gemma 3) a
        # second one, with its own base and no scaling, for the sliding-window layers.
        self._rotary = [rotary]
        if cfg.rope_local_theta is not None:
            self._rotary.append(RotaryEmbedding(cfg.rotary_dim, cfg.rope_local_theta,
                                                max_positions, None, cfg.max_position_embeddings))
        # layer -> index of its table in _rotary
        self._layer_rope = [1 if len(self._rotary) > 1 and cfg.layer_window(i) else 0
                            for i in range(cfg.num_hidden_layers)]
        # _layer_stack's: the layers' Attention modules (None: not looked at yet; []: the layers
        # cannot run as one stack), and (their KV stores, the LayerStack built on them)
        self._stack_attns: list[Attention] | None = None
        self._stack_experts: list = []  # per layer its Experts (a MoE layer) or None
        self._stack: tuple[list, object] | None = None
        # _mla_stack's: per layer (its Attention, its Experts or None), and (their KV stores and
        # routing counters, the MlaStack built on them or None)
        self._mla_watch: list[tuple] | None = None
        self._mla: tuple[list, object | None] | None = None
        self.layers = nn.ModuleList(
            make_layer(i, self._rotary[self._layer_rope[i]]) if make_layer is not None else
            LlamaDecoderLayer(cfg, rotary, make_mlp(i) if make_mlp else None, i)
            for i in range(cfg.num_hidden_layers))
        norm_kw = {"offset": cfg.norm_offset, "weight_in_float": cfg.norm_layout != "pre"}
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm_kw)
        # Gemma: sqrt(hidden) rounded to the activation dtype, as its embedding module does;
        # Granite: its multiplier as a Python float.
        self.embed_scale: float | None = (
            cfg.hidden_size ** 0.5 if cfg.scale_embeddings else
            cfg.embedding_multiplier if cfg.embedding_multiplier != 1.0 else None)
        self.embed_scale_in_dtype = cfg.scale_embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:
            x = x * (torch.tensor(self.embed_scale).to(x.dtype) if self.embed_scale_in_dtype
                     else self.embed_scale)
        # cos/sin once per step and table, not per layer
        tables = [r.lookup(positions, x.dtype) for r in self._rotary]
        if layer_call is kernel_layer_call and (stack := self._layer_stack()) is not None:
            meta = get_context()
            assert meta.step_rows is not None
            x = ops.decode_stack(x, *tables[0], stack, meta.slot_mapping, *meta.step_rows)
            return self.norm(x)
        if layer_call is kernel_layer_call and (mla := self._mla_stack()) is not None:
            meta = get_context()
            assert meta.step_rows is not None
            x = ops.mla_stack(x, *tables[0], mla, meta.slot_mapping, *meta.step_rows)
            return self.norm(x)
        for layer, rope in zip(self.layers, self._layer_rope):
            cos, sin = tables[rope]
            x = layer(cos, sin, x) if layer_call is None else layer_call(layer, cos, sin, x)
        return self.norm(x)

    def _layer_stack(self) -> object | None:
        """The layer kernels' arguments of every layer, gathered once into one LayerStack
        (layers.cpp), so that a kernel step runs all its layers in one call (decode_stack:
        the very decode_layer / moe_layer calls forward_decode_kernel makes, without a Python
        round trip and 21-27 converted arguments per layer). None: layer by layer, where a step
        has LoRA rows (their adapters are per step), a layer does not run on the layer kernels
        (decode_kernel_rows), or the layers use two RoPE tables. Rebuilt when a layer's KV
        store or routing counters are replaced (the runner swaps in scratch pools to profile)."""
        if lora.step_active():
            return None
        if self._stack_attns is None:  # once: the layers and their kernels do not change
            ok = len(self._rotary) == 1 and all(
                type(layer).forward_decode_kernel is LlamaDecoderLayer.forward_decode_kernel
                and layer.decode_kernel_rows() > 0 for layer in self.layers)
            # (kept: reaching them through nn.Module's __getattr__ every step cost ~0.1 ms of
            # an 8 ms SmolLM2 step)
            self._stack_attns = [layer.self_attn.attn for layer in self.layers] if ok else []
            self._stack_experts = [layer.mlp.experts if layer._moe_args() is not None else None
                                   for layer in self.layers] if ok else []
        if not self._stack_attns:
            return None
        key = [a.kv for a in self._stack_attns] + [
            e.tokens_per_expert for e in self._stack_experts if e is not None]
        if self._stack is None or any(a is not b for a, b in zip(key, self._stack[0])):
            self._stack = (key, self._build_stack())
        return self._stack[1]

    def _mla_stack(self) -> object | None:
        """DeepSeek's layers as one MlaStack (mla.cpp) of their MlaLayers (`_mla_kernel`), so
        that a kernel step runs them in one call (mla_stack); rebuilt when what a layer's
        MlaLayer is built on is replaced (its KV store, its routing counters: `mla_watch`).
        None where the layers have none (other families) or a step has LoRA rows."""
        if lora.step_active():
            return None
        if self._mla_watch is None:  # once (asking 24 layers through nn.Module each step: ~2%)
            self._mla_watch = ([layer.mla_watch() for layer in self.layers]
                               if hasattr(self.layers[0], "mla_watch") else [])
        if not self._mla_watch:
            return None
        key = [a.kv for a, _ in self._mla_watch] + [
            e.tokens_per_expert for _, e in self._mla_watch if e is not None]
        if self._mla is None or any(a is not b for a, b in zip(key, self._mla[0])):
            layers = [layer._mla_kernel() for layer in self.layers]
            stack = None
            if all(m is not None for m in layers):
                stack = ops.mla_stack_object()
                for m in layers:
                    stack.add(m)
            self._mla = (key, stack)
        return self._mla[1]

    def _build_stack(self) -> object:
        stack = ops.layer_stack()
        none = torch.empty(0)
        for layer, experts in zip(self.layers, self._stack_experts):
            attn, kv = layer.self_attn, layer.self_attn.attn.kv
            q_norm, k_norm, qk_eps = attn.qk_norms() or (none, none, 0.0)
            args = layer._moe_args() if experts is not None else layer._layer_args()
            weights, kinds, rows, counts, biases = args
            common = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                      layer.input_layernorm.eps, weights, kinds, rows, counts,
                      [b if b is not None else none for b in biases], kv.k, kv.v,
                      attn.num_heads, attn.attn.scale, q_norm, k_norm, qk_eps)
            if experts is None:
                stack.add(*common)
            else:
                mlp = layer.mlp
                stack.add_moe(*common, mlp.gate.weight, mlp.top_k, mlp.renormalize,
                              experts.w13_q4, experts.w2_q4, experts.tokens_per_expert,
                              experts.num_shared, mlp.shared_gate_in_router)
        return stack


def kernel_layer_call(layer: nn.Module, cos: torch.Tensor, sin: torch.Tensor,
                      x: torch.Tensor) -> torch.Tensor:
    """The runner's layer call for kernel steps: each layer as one kernel call
    (LlamaDecoderLayer.forward_decode_kernel); LlamaModel runs all of them as one stack
    where it can."""
    return layer.forward_decode_kernel(cos, sin, x)  # type: ignore[operator]


class LlamaForCausalLM(nn.Module):
    packed_modules = PACKED

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions, self.make_mlp, self.make_layer)
        self.lm_head: nn.Module = (TiedLMHead(self.model.embed_tokens) if cfg.tie_word_embeddings
                                   else Linear(cfg.hidden_size, cfg.vocab_size))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                layer_call: LayerCall | None = None) -> torch.Tensor:
        """`layer_call(layer, cos, sin, x)` runs each decoder layer instead of calling it
        (the model runner passes a torch.compile'd one for decode steps)."""
        return self.model(input_ids, positions, layer_call)

    def make_mlp(self, layer: int) -> nn.Module | None:
        """Layer `layer`'s MLP; None: the dense LlamaMLP (MoE families return their block)."""
        return None

    # A family with its own decoder layer sets this to a method (layer, rotary) -> module.
    make_layer: Callable[[int, RotaryEmbedding], nn.Module] | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cfg = self.config
        if cfg.logits_scaling != 1.0:  # Granite
            logits = logits / cfg.logits_scaling
        if cfg.final_logit_softcapping:  # Gemma 2
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def rotary_embeddings(self) -> list[RotaryEmbedding]:
        return self.model._rotary
