"""Encoder-only models (BERT, RoBERTa / XLM-R, MPNet, ModernBERT, NomicBERT;
encoder_config.py): a flat batch of whole sequences in, each token's final hidden state out,
then pooled (`embed`) or through the architecture's classification head (`classify`). No KV
cache: every token of a sequence sees every token of it and none of another's
(ops.encoder_attention).

Linears are kernels.linear.Linear and norms, GELUs and attention go through the backend's
`ops`, so Backend.prepare lays the weights out for the native tiers (BF16 tiles, oneDNN
packing) as for the decoders; this code never asks which tier runs it.

    model = load_encoder(path, torch.float32, ops, torch.device("cpu"))   # encoder_load.py
    hidden = model(input_ids, token_types, seq_lens)       # [T, H], the model's dtype
    vectors = model.embed(hidden, seq_lens, "MEAN")        # [B, H] float32
    logits = model.classify(hidden, seq_lens)              # [B, num_labels] float32
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from pagewire.kernels.linear import Linear
from pagewire.kernels.ops import TorchOps
from pagewire.kernels.rotary import rope_cos_sin

from ..parallel import TensorParallel
from .encoder_config import GELU_FORMS, MPNET_BUCKETS, EncoderConfig
from .llama import LayerNorm


@dataclass
class EncoderBatch:
    """What every layer reads of one forward: the sequences' lengths, each token's position
    within its sequence, and MPNet's relative position bias [H, L, L] (None elsewhere)."""
    seq_lens: list[int]
    offsets: torch.Tensor            # [T] int64: index of each token within its sequence
    bias: torch.Tensor | None = None


def activation(name: str, x: torch.Tensor, ops) -> torch.Tensor:
    """transformers' ACT2FN[name] for the encoders' activations; GELUs on the backend's."""
    if name == "relu":
        return torch.relu(x)
    if name == "tanh":
        return torch.tanh(x)
    return ops.gelu(x.contiguous(), GELU_FORMS[name])


class EncoderLayer(nn.Module):
    """Self-attention and MLP. Post-norm (BERT, RoBERTa, MPNet, NomicBERT: LN(x +
    sublayer(x))) or pre-norm (ModernBERT: x + sublayer(LN(x)), no norm before layer 0's
    attention, every local layer a window). ModernBERT and NomicBERT rotate q and k and gate
    their MLP (GeGLU: act(input) * gate; SwiGLU: silu(gate) * up, its rows gate first)."""

    def __init__(self, cfg: EncoderConfig, index: int):
        super().__init__()
        d, inner, self.cfg = cfg.hidden_size, cfg.intermediate_size, cfg
        self.pre_norm = cfg.family == "modernbert"
        self.qkv = Linear(d, 3 * d, bias=cfg.attention_bias)       # q, k, v stacked by rows
        self.out = Linear(d, d, bias=cfg.attention_bias)
        self.attn_norm = None if self.pre_norm and index == 0 else \
            LayerNorm(d, cfg.layer_norm_eps)
        self.up = Linear(d, 2 * inner if cfg.rotary else inner, bias=cfg.mlp_bias)
        self.down = Linear(inner, d, bias=cfg.mlp_bias)
        self.mlp_norm = LayerNorm(d, cfg.layer_norm_eps)
        self.local = self.pre_norm and not cfg.global_layers[index]
        self.window = cfg.local_window if self.local else None

    def attention(self, ops, h: torch.Tensor, batch: EncoderBatch,
                  rope: torch.Tensor | None) -> torch.Tensor:
        t, d = h.shape
        heads, head_dim = self.cfg.num_heads, self.cfg.head_dim
        qkv = ops.linear(self.qkv, h)
        if rope is not None:
            q, k, v = ops.split_qkv_rope(qkv, heads, heads, head_dim, rope, batch.offsets)
        else:
            q, k, v = qkv.view(t, 3, heads, head_dim).unbind(1)
        attn = ops.encoder_attention(q, k, v, batch.seq_lens, head_dim ** -0.5,
                                     bias=batch.bias, window=self.window)
        return ops.linear(self.out, attn.reshape(t, d))

    def mlp(self, ops, h: torch.Tensor) -> torch.Tensor:
        up = ops.linear(self.up, h)
        if self.cfg.hidden_act == "silu":                     # SwiGLU: silu(gate) * up
            up = ops.silu_and_mul(up)
        elif self.cfg.rotary:                                 # GeGLU: act(input) * gate
            x, gate = up.chunk(2, dim=-1)
            up = activation(self.cfg.hidden_act, x, ops) * gate
        else:
            up = activation(self.cfg.hidden_act, up, ops)
        return ops.linear(self.down, up)

    def post_norm_forward(self, ops, x: torch.Tensor, batch: EncoderBatch,
                          rope: torch.Tensor | None) -> torch.Tensor:
        """x: the last layer's output (the embeddings' for layer 0) -> this layer's. The
        fused add+norm sums into x's storage (the native one in place): x is not read after."""
        h, _ = self.attn_norm.forward(ops, self.attention(ops, x, batch, rope), x)
        out, _ = self.mlp_norm.forward(ops, self.mlp(ops, h), h)
        return out

    def pre_norm_forward(self, ops, x: torch.Tensor, residual: torch.Tensor | None,
                         batch: EncoderBatch, rope: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """As the decoders' blocks: x the last sublayer's output, residual the stream before
        it (None at layer 0, whose x is the stream) -> this layer's MLP output and stream."""
        if self.attn_norm is None:
            h, residual = x, (x if residual is None else x + residual)
        else:
            h, residual = self.attn_norm.forward(ops, x, residual)
        h, residual = self.mlp_norm.forward(ops, self.attention(ops, h, batch, rope), residual)
        return self.mlp(ops, h), residual


class EncoderModel(nn.Module):
    """input_ids [T] of whole sequences (seq_lens, in order) -> hidden states [T, H]."""

    def __init__(self, cfg: EncoderConfig, ops=None):
        super().__init__()
        d, self.cfg = cfg.hidden_size, cfg
        self.ops = ops if ops is not None else TorchOps()
        self.tp = TensorParallel()           # one rank (read_encoder refuses more)
        self.words = nn.Embedding(cfg.vocab_size, d)
        self.positions = None if cfg.rotary else nn.Embedding(cfg.max_position_embeddings, d)
        self.token_types = nn.Embedding(cfg.type_vocab_size, d) if cfg.type_vocab_size else None
        self.embed_norm = LayerNorm(d, cfg.layer_norm_eps)
        self.layers = nn.ModuleList(EncoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.relative_bias = nn.Embedding(cfg.relative_buckets, cfg.num_heads) \
            if cfg.family == "mpnet" else None
        self.final_norm = LayerNorm(d, cfg.layer_norm_eps) if cfg.family == "modernbert" \
            else None
        self.head_dense = self.head_norm = self.classifier = None
        modern = cfg.family == "modernbert"
        if cfg.classifier or cfg.token_classifier:
            # a token classifier's head is its classifier alone, but ModernBERT's (dense,
            # activation, norm first, as for its sequences)
            if cfg.classifier or modern:
                self.head_dense = Linear(d, d, bias=cfg.classifier_bias)
            self.head_norm = LayerNorm(d, cfg.layer_norm_eps) if modern else None
            self.classifier = Linear(d, cfg.num_labels)
        self.register_buffer("global_rope", None, persistent=False)
        self.register_buffer("local_rope", None, persistent=False)
        self.reset_buffers()

    @property
    def weights_dtype(self) -> torch.dtype:
        """The model's float dtype (Backend.prepare reads it: `embed` is the pooling here)."""
        return self.words.weight.dtype

    def reset_buffers(self) -> None:
        """The (cos | sin) tables, one a rope base (ModernBERT's two, NomicBERT's one), float32
        on the CPU (Module.to moves them)."""
        cfg = self.cfg
        if cfg.rotary:
            self.global_rope = rope_cos_sin(cfg.head_dim, cfg.max_position_embeddings,
                                            cfg.global_rope_theta)
        if cfg.family == "modernbert":
            self.local_rope = rope_cos_sin(cfg.head_dim, cfg.max_position_embeddings,
                                           cfg.local_rope_theta)

    def forward(self, input_ids: torch.Tensor, token_types: torch.Tensor | None,
                seq_lens: list[int]) -> torch.Tensor:
        """input_ids, token_types: [T] int64 (token_types None: all 0; read by BERT only, 1
        from a pair's second text on); seq_lens (each >= 1) sums to T. Returns [T, H] in the
        model's dtype."""
        batch = self._batch(seq_lens, input_ids.device)
        x = self._embeddings(input_ids, token_types, batch)
        ops = self.ops
        if self.final_norm is None:
            for layer in self.layers:
                x = layer.post_norm_forward(ops, x, batch, self.global_rope)
            return x
        residual = None
        for layer in self.layers:
            rope = self.local_rope if layer.local else self.global_rope
            x, residual = layer.pre_norm_forward(ops, x, residual, batch, rope)
        return self.final_norm.forward(ops, x, residual)[0]

    def _batch(self, seq_lens: list[int], device) -> EncoderBatch:
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=device)
        starts = torch.cumsum(lens, 0) - lens
        offsets = torch.arange(int(lens.sum()), device=device) - \
            torch.repeat_interleave(starts, lens)
        bias = None
        if self.relative_bias is not None:
            bias = mpnet_position_bias(self.relative_bias.weight, max(seq_lens))
        return EncoderBatch(list(seq_lens), offsets, bias)

    def _embeddings(self, input_ids: torch.Tensor, token_types: torch.Tensor | None,
                    batch: EncoderBatch) -> torch.Tensor:
        """transformers' embeddings, added in its order: (words + types) + positions, then
        the norm."""
        x = self.words(input_ids)
        if self.token_types is not None:
            # RoBERTa's and XLM-R's tokenizers give no token types (a pair's second text is
            # type 0 too): only BERT and NomicBERT (a BERT tokenizer) read them
            use = token_types is not None and self.cfg.family in ("bert", "nomic")
            x = x + self.token_types(token_types if use else torch.zeros_like(input_ids))
        if self.positions is not None:
            x = x + self.positions(self._positions(input_ids, batch))
        return self.embed_norm.forward(self.ops, x.contiguous())[0]

    def _positions(self, input_ids: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        """BERT: 0..n-1 a sequence. RoBERTa, XLM-R, MPNet: transformers'
        create_position_ids_from_input_ids: a token's count of non-padding tokens up to it
        (its own included) after padding_idx, padding tokens at padding_idx."""
        pad = self.cfg.padding_idx
        if pad is None:
            return batch.offsets
        real = (input_ids != pad).long()
        counted = torch.cumsum(real, 0)
        first = batch.offsets == 0                 # a sequence's count restarts at its start
        before = (counted - real)[first]
        lens = torch.tensor(batch.seq_lens, device=input_ids.device)
        counted = counted - torch.repeat_interleave(before, lens)
        return counted * real + pad

    def embed(self, hidden: torch.Tensor, seq_lens: list[int], pooling_type: str
              ) -> torch.Tensor:
        """Each sequence's vector [B, H] float32: its first token's state ("CLS"), its last
        ("LAST") or the mean of its tokens' ("MEAN")."""
        return pool(hidden, seq_lens, pooling_type)

    def classify(self, hidden: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """The classification head's logits [B, num_labels] float32: BERT's pooler (dense,
        tanh) on the first token, then its classifier; RoBERTa's, XLM-R's and MPNet's
        dense, tanh, out_proj on the first token; ModernBERT's dense, activation, norm on the
        first token or the mean (classifier_pooling), then its classifier."""
        if self.classifier is None:
            raise ValueError(f"{self.cfg.architecture} has no classification head")
        cfg, ops = self.cfg, self.ops
        kind = "MEAN" if cfg.classifier_pooling == "mean" else "CLS"
        x = pool(hidden, seq_lens, kind).to(hidden.dtype)
        x = activation(cfg.classifier_activation, ops.linear(self.head_dense, x), ops)
        if self.head_norm is not None:
            x = self.head_norm.forward(ops, x.contiguous())[0]
        return ops.linear(self.classifier, x).float()


    def classify_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """A token classifier's logits for every token [T, num_labels] float32: its
        classifier on each final state (ModernBERT's: dense, activation, norm first)."""
        if not self.cfg.token_classifier:
            raise ValueError(f"{self.cfg.architecture} does not classify tokens")
        ops, x = self.ops, hidden
        if self.head_dense is not None:
            x = activation(self.cfg.classifier_activation, ops.linear(self.head_dense, x), ops)
            x = self.head_norm.forward(ops, x.contiguous())[0]
        return ops.linear(self.classifier, x).float()


def pool(hidden: torch.Tensor, seq_lens: list[int], pooling_type: str) -> torch.Tensor:
    """[T, H] -> [B, H] float32 (EncoderModel.embed's pooling types)."""
    lens = torch.tensor(seq_lens, dtype=torch.int64, device=hidden.device)
    ends = torch.cumsum(lens, 0)
    if pooling_type == "CLS":
        return hidden[ends - lens].float()
    if pooling_type == "LAST":
        return hidden[ends - 1].float()
    if pooling_type == "MEAN":
        seq_of = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device),
                                         lens)
        sums = hidden.new_zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32)
        return sums.index_add_(0, seq_of, hidden.float()) / lens[:, None]
    raise ValueError(f"pooling type {pooling_type!r} is not one of CLS, MEAN, LAST")


def mpnet_position_bias(table: torch.Tensor, length: int) -> torch.Tensor:
    """MPNet's relative position bias [H, L, L] for sequences of up to `length` tokens:
    relative_attention_bias rows at T5's bidirectional buckets of key - query position
    (transformers' MPNetEncoder.compute_position_bias, 32 buckets, max distance 128)."""
    pos = torch.arange(length, device=table.device)
    relative = pos[None, :] - pos[:, None]
    n = -relative
    half = MPNET_BUCKETS // 2
    bucket = (n < 0).long() * half
    n = n.abs()
    exact = half // 2
    large = exact + (torch.log(n.float() / exact) / math.log(128 / exact)
                     * (half - exact)).long()
    bucket = bucket + torch.where(n < exact, n, large.clamp(max=half - 1))
    return table[bucket].permute(2, 0, 1)
