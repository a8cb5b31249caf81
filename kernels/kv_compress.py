"""KV-Compress: attention over caches kept per (layer, KV head), each evicting its own
least-attended tokens.

Layout. One pool for every layer, pool[2, num_sub_blocks, block_size, 1, W] (W: D, or D + 4
for a quantized cache, kv_quant.py). A sequence's KV is H = layers x KV heads "head rows",
each with its own table of sub-blocks and its own length: a row that evicted tokens is shorter
than its sequence, and rows evict at different rates. Rows keep their tokens in position
order with the evicted ones squeezed out (keys are stored rotated, so a key needs no position
once written); this step's tokens are the last entries of every row.

So a layer attends its rows as sequences of one KV head: a decode token's Hq query heads are
Hkv rows of G = Hq / Hkv heads ([B, Hq, D] viewed as [B Hkv, G, D]), for the backend's own
decode kernel. Prefill spans run only on rows that evicted nothing yet (compression follows a
prompt's last chunk), so every row of a span is its sequence's context.

Which tokens go: the attention each key receives from the sequence's latest queries (at most
`OBSERVED` of them, all query heads of its group), summed (`attention_mass`); per layer the
lowest-scoring tokens outside every row's protected recent window, across the layer's rows,
until the layer holds `keep` tokens a row on average (`choose_kept`). Rows of one layer thus
keep different counts: the variable rates per head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import kv_quant
from .attention import PLAIN, Variant, attend, causal_mask

OBSERVED = 16      # queries (the latest ones) whose attention scores the keys


@dataclass
class Observed:
    """A sequence compressing at the end of this step: its rows of the batch, its head rows'
    sub-block tables [H, nb] and lengths [H] once this step's tokens are written; each layer
    fills scores[layer] with its rows' attention mass [Hkv, nb * bs]."""
    start: int
    num_tokens: int
    tables: torch.Tensor
    lens: torch.Tensor
    scores: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class HeadBatch:
    """The step's head rows, every layer's (built once a step; layer l reads index l)."""
    slots: torch.Tensor                  # [L, T Hkv] int64: token t, KV head h at t Hkv + h
    decode_tables: torch.Tensor | None   # [L, B Hkv, max sub-blocks] int64 (decode rows)
    decode_lens: torch.Tensor | None     # [L, B Hkv] int64, this step's token included
    prefill_tables: list[torch.Tensor]   # per prefill span: [L, Hkv, nb] int64
    observed: list[Observed]

    def to(self, dev: torch.device) -> "HeadBatch":
        """A copy on `dev` whose Observed share their scores with this batch's: the layers
        fill them there, the compression after the step reads them here."""
        def move(t):
            return None if t is None else t.to(dev)
        return HeadBatch(move(self.slots), move(self.decode_tables), move(self.decode_lens),
                         [move(t) for t in self.prefill_tables],
                         [Observed(o.start, o.num_tokens, move(o.tables), move(o.lens),
                                   o.scores) for o in self.observed])


def compressed_attention(ops, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         pool: torch.Tensor, batch, scale: float,
                         variant: Variant = PLAIN) -> torch.Tensor:
    """paged_attention's contract over head rows (batch.heads, a HeadBatch): q [T, Hq, D];
    k, v [T, Hkv, D] are written to their rows, then each token attends its rows. The
    sequences compressing after this step get their keys' attention mass recorded."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    heads = batch.heads
    ops.write_kv(pool, k.reshape(t * hkv, 1, d), v.reshape(t * hkv, 1, d), heads.slots[layer])
    out = torch.empty_like(q)
    nd = batch.num_decode_tokens
    if nd:
        rows = q[:nd].reshape(nd * hkv, hq // hkv, d)                   # [B Hkv, G, D]
        out[:nd] = ops.decode(rows, pool, heads.decode_tables[layer], heads.decode_lens[layer],
                              scale, variant).view(nd, hq, d)
    for span, tables in zip(batch.prefills, (t[layer] for t in heads.prefill_tables)):
        end = span.start + span.num_tokens
        out[span.start:end] = _prefill(q[span.start:end], k[span.start:end], v[span.start:end],
                                       pool, tables, span.context_len, scale, variant)
    for obs in heads.observed:
        w = min(OBSERVED, obs.num_tokens)
        end = obs.start + obs.num_tokens
        tables, lens = obs.tables.view(-1, hkv, obs.tables.shape[1])[layer], \
            obs.lens.view(-1, hkv)[layer]
        obs.scores[layer] = attention_mass(q[end - w:end], pool, tables, lens, scale, variant)
    return out


def _prefill(q, k, v, pool, tables, context_len: int, scale: float, variant: Variant):
    """One span's causal attention: its fresh k, v when the span is its whole context, else
    every row read back from its sub-blocks ([Hkv, nb] tables, all rows context_len long)."""
    n = q.shape[0]
    if context_len == n and variant.plain and not kv_quant.is_quantized(pool):
        return attend(q, k, v, None, True, scale)
    keys = _rows(pool[0], tables, q.dtype)[:, :context_len].transpose(0, 1)   # [ctx, Hkv, D]
    values = _rows(pool[1], tables, q.dtype)[:, :context_len].transpose(0, 1)
    mask = causal_mask(n, context_len, q.device, variant.window)
    return attend(q, keys, values, mask, False, scale, variant)


def _rows(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """cache [num_sub_blocks, bs, 1, W], tables [R, nb] -> the rows' slots [R, nb bs, D]."""
    r, nb = tables.shape
    return kv_quant.readable(cache[tables], dtype).reshape(r, nb * cache.shape[1], -1)


def attention_mass(q: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor,
                   lens: torch.Tensor, scale: float, variant: Variant = PLAIN) -> torch.Tensor:
    """q [w, Hq, D]: a sequence's latest w queries, at the last w entries of each of its rows
    (tables [Hkv, nb], lens [Hkv]). -> [Hkv, nb bs] float32: the attention each row's keys get
    from those queries (causally), summed over them and the row's G query heads; 0 past a
    row's length."""
    w, hq, d = q.shape
    hkv = tables.shape[0]
    keys = _rows(pool[0], tables, torch.float32)                              # [Hkv, C, D]
    qg = q.float().view(w, hkv, hq // hkv, d).permute(1, 2, 0, 3)            # [Hkv, G, w, D]
    scores = torch.matmul(qg, keys.transpose(1, 2)[:, None]) * scale         # [Hkv, G, w, C]
    if variant.softcap is not None:
        scores = torch.tanh(scores / variant.softcap) * variant.softcap
    pos = torch.arange(keys.shape[1], device=q.device)
    q_pos = lens[:, None] - w + torch.arange(w, device=q.device)             # [Hkv, w]
    visible = pos[None, None, :] <= q_pos[:, :, None]                         # [Hkv, w, C]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    return scores.softmax(-1).sum((1, 2))                                     # [Hkv, C]


def choose_kept(mass: torch.Tensor, lens: torch.Tensor, keep: int,
                window: int) -> list[torch.Tensor]:
    """Which tokens each of a layer's rows keeps: mass [Hkv, C] (attention_mass), lens [Hkv].
    Every row keeps its last `window` tokens; of the others, the layer keeps the most attended
    ones, across its rows, until it holds Hkv * keep tokens (or all it has). Returns per row
    the kept indices, ascending (their order in the row)."""
    hkv, width = mass.shape
    pos = torch.arange(width, device=mass.device)[None, :]
    valid = pos < lens[:, None]
    protected = valid & (pos >= lens[:, None] - window)
    candidates = valid & ~protected
    budget = hkv * keep - int(protected.sum())
    kept = protected.clone()
    if budget >= int(candidates.sum()):
        kept |= candidates
    elif budget > 0:
        chosen = mass.masked_fill(~candidates, float("-inf")).flatten().topk(budget).indices
        kept.view(-1)[chosen] = True
    return [kept[h].nonzero().flatten() for h in range(hkv)]
