"""BERT-family encoders (BertModel: all-MiniLM-L6-v2, bge; RobertaModel / XLMRobertaModel:
bge-m3, multilingual-e5), for embeddings only.

An encoder attends both ways over the whole input at once, so it has no KV cache and no decode
step: a batch is padded to its longest input ([B, L]) and run once, the padding masked out of
every key. Attribute names mirror the Hugging Face checkpoint (`embeddings.word_embeddings`,
`encoder.layer.N.attention.self.query`, ...), so the weights load by name; the pooler and an MLM
head, which embeddings do not use, are skipped.

Numerics follow transformers' BertModel in float32 (post-LayerNorm residual blocks, exact erf GELU
for "gelu", SDPA attention with the padding masked): hidden states agree to ~1e-5.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.errors import ModelLoadError
from kiln.models.config import ModelConfig

_ACT = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
}
# Checkpoint tensors an embedding does not read: BertModel's pooler (a tanh layer over [CLS]
# for next-sentence prediction), the MLM/NSP heads of a *ForPreTraining checkpoint, and the
# position_ids buffer some exporters save.
_UNUSED = ("pooler.", "cls.", "lm_head.", "embeddings.position_ids")


def _empty_linear(n_in: int, n_out: int) -> nn.Linear:
    # The weights are overwritten by the checkpoint: skip nn.Linear's random init.
    lin = nn.Linear(n_in, n_out, device="meta")
    return lin.to_empty(device="cpu")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h, _weight=torch.empty(cfg.vocab_size, h))
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h,
                                                _weight=torch.empty(cfg.max_position_embeddings, h))
        # RoBERTa numbers positions from padding_idx + 1 (transformers'
        # create_position_ids_from_input_ids); padding rows are masked, so their ids don't matter.
        roberta = cfg.architecture in ("RobertaModel", "XLMRobertaModel")
        pad = cfg.pad_token_id if cfg.pad_token_id is not None else 1
        self.position_offset = pad + 1 if roberta else 0
        types = max(1, cfg.type_vocab_size)
        self.token_type_embeddings = nn.Embedding(types, h, _weight=torch.zeros(types, h))
        self.LayerNorm = nn.LayerNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None
                ) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device) + \
            self.position_offset
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)[None]
        if token_type_ids is None:  # one segment: type 0 everywhere, as transformers defaults
            x = x + self.token_type_embeddings.weight[0]
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = h // self.num_heads
        self.query = _empty_linear(h, h)
        self.key = _empty_linear(h, h)
        self.value = _empty_linear(h, h)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

        o = F.scaled_dot_product_attention(heads(self.query(x)), heads(self.key(x)),
                                           heads(self.value(x)), attn_mask=mask)
        return o.transpose(1, 2).reshape(b, n, -1)


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: ModelConfig, n_in: int) -> None:
        super().__init__()
        self.dense = _empty_linear(n_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = _empty_linear(cfg.hidden_size, cfg.intermediate_size)
        if cfg.hidden_act not in _ACT:
            raise ModelLoadError(f"BERT activation {cfg.hidden_act!r} is not supported",
                                 hint=f"supported: {', '.join(_ACT)}")
        self.act = _ACT[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertSelfOutput(cfg, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(cfg) for _ in range(cfg.num_hidden_layers))


class BertModel(nn.Module):
    """`forward(input_ids [B, L], attention_mask [B, L] bool) -> last hidden states [B, L, H]`."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embeddings(input_ids, token_type_ids)
        # [B, 1, 1, L]: every query may read every real key; padding keys are masked.
        mask = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    def load_checkpoint_tensors(self, tensors: object) -> None:
        """Fills every parameter from (name, tensor) pairs (`kiln.models.loader.iter_tensors`);
        a tensor the encoder does not know, or a parameter left unfilled, is an error naming
        it. Names may carry the `bert.` / `roberta.` prefix of a *ForMaskedLM checkpoint."""
        params = dict(self.named_parameters())
        seen: set[str] = set()
        for name, tensor in tensors:  # type: ignore[attr-defined]
            name = name.removeprefix("bert.").removeprefix("roberta.")
            if name.startswith(_UNUSED):
                continue
            if name not in params:
                raise ModelLoadError(f"unknown BERT tensor {name!r} in the checkpoint",
                                     hint="kiln's BertModel runs BertModel checkpoints")
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise ModelLoadError(f"BERT tensor {name!r} has shape {tuple(tensor.shape)}, "
                                     f"the config says {tuple(p.shape)}")
            with torch.no_grad():
                p.copy_(tensor)
            seen.add(name)
        # A single-segment checkpoint may leave token types out: they stay zero.
        missing = sorted(set(params) - seen - {"embeddings.token_type_embeddings.weight"})
        if missing:
            raise ModelLoadError(f"the checkpoint lacks BERT tensors {missing[:4]}"
                                 f"{' ...' if len(missing) > 4 else ''}")
