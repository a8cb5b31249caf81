"""The tokenizer actor's part of a pooling request (wire/pooling.py): a text, a cross-encoder's
(text, pair) or token ids encoded as the model's tokenizer encodes them for its pooler (special
tokens added, a pair as one input with its segment boundary), truncated where asked, refused
where longer than the context."""
from __future__ import annotations

from pagewire.wire.pooling import PoolingInput, PoolingSeq
from pagewire.wire.to_tokenizer import TokenizeRequest

from pagewire.wire.sampling_params import InvalidParam


def encode_pooled(tokenizer, req: TokenizeRequest, max_model_len: int,
                  vocab_size: int) -> tuple[list[int], PoolingSeq]:
    """(prompt ids, the NewRequest's pooling section). A pooled prompt may fill the whole
    context (nothing is generated after it)."""
    pooling: PoolingInput = req.pooling
    limit = pooling.truncate_prompt_tokens
    if limit is not None and (limit == 0 or limit < -1):
        raise InvalidParam("truncate_prompt_tokens", "truncate_prompt_tokens must be -1 (the "
                           f"model's context) or positive, got {limit}")
    keep = max_model_len if limit == -1 else limit
    if keep is not None and keep > max_model_len:
        raise InvalidParam("truncate_prompt_tokens", f"truncate_prompt_tokens={keep} is longer "
                           f"than the model's context ({max_model_len} tokens)")
    ids, pair_start = _encode(tokenizer, req, keep)
    bad = [t for t in ids if not 0 <= t < vocab_size]    # ids given, or a tokenizer wider
    if bad:                                              # than the model's embedding
        raise InvalidParam("input", f"token id {bad[0]} is out of range [0, {vocab_size})")
    if not ids:
        raise InvalidParam("input", "the input is empty (it encodes to no token)")
    if len(ids) > max_model_len:
        raise InvalidParam("input", f"This model's maximum context length is {max_model_len} "
                           f"tokens. However, the input has {len(ids)} tokens; pass "
                           "truncate_prompt_tokens to truncate it.")
    return ids, PoolingSeq(pair_start=pair_start, per_token=pooling.per_token)


def _encode(tokenizer, req: TokenizeRequest, keep: int | None) -> tuple[list[int], int]:
    """Token ids and where a pair's second text starts (its first token of type 1; 0 for one
    text, or a tokenizer whose pairs have one token type, RoBERTa's)."""
    pair = req.pooling.pair
    if req.prompt_token_ids is not None:
        if pair is not None:
            raise InvalidParam("input", "a pair is scored from texts, not token ids")
        ids = list(req.prompt_token_ids)
        if keep is not None and len(ids) > keep:
            ids = ids[-keep:] if tokenizer.truncation_side == "left" else ids[:keep]
        return ids, 0
    if req.prompt is None:
        raise InvalidParam("input", "a pooling request takes a text or token ids")
    kwargs = dict(truncation=True, max_length=keep) if keep is not None else {}
    encoded = tokenizer(req.prompt, pair, add_special_tokens=True,
                        return_token_type_ids=pair is not None, **kwargs)
    types = encoded.get("token_type_ids") or []
    return list(encoded["input_ids"]), next((i for i, t in enumerate(types) if t == 1), 0)
