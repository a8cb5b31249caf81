"""Messages a tokenizer receives (from the gateway)."""
from __future__ import annotations

import msgspec

from .kv_transfer import KvTransfer
from .lora import LoraRef
from .pooling import PoolingInput
from .sampling_params import SamplingParams


class ChatMessage(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None     # an assistant's calls: {id, type, function}
    tool_call_id: str | None = None          # a tool message: the call it answers
    image_slots: list[int] | None = None     # where in content the request's images go, in
                                             # order (character offsets; the tokenizer puts
                                             # the model's image placeholder there)


class TokenizeRequest(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """One generation request, before tokenization. Exactly one of prompt, prompt_token_ids and
    messages is set (the gateway guarantees it)."""
    req_id: str
    arrival_time: float                  # time.time() at the gateway
    sampling: SamplingParams
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    cache_salt: str | None = None        # requests with different salts never share KV blocks
    priority: int = 0                    # lower runs first under the priority policy
    echo: bool = False                   # send the prompt's text ahead of the output
    chat_template_kwargs: dict[str, bool | int | float | str | None] = {}
    tools: list[dict] | None = None      # OpenAI tool objects, for the chat template
    lora: LoraRef | None = None          # the adapter it runs with; None: the base model
    kv_transfer: KvTransfer | None = None   # disaggregated prefill/decode (kv_transfer.py)
    prompt_open: bool = False            # more of the prompt follows in TokenizePieces
    images: list[bytes] = []             # image files (PNG, JPEG, ...), one per placeholder
    pooling: PoolingInput | None = None  # a prompt to pool, not continue (pooling.py)


class TokenizePiece(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """More of an open prompt (TokenizeRequest.prompt_open): text, encoded on its own without
    special tokens, or token ids; `last` closes the prompt. A piece that cannot be encoded is
    answered with a RequestFailed under `reply_id`."""
    req_id: str
    reply_id: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    last: bool = False


class TokenizeOnly(msgspec.Struct, tag=True, kw_only=True, omit_defaults=True):
    """/tokenize: encode a prompt or chat messages and answer the gateway; nothing runs."""
    req_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, bool | int | float | str | None] = {}
    tools: list[dict] | None = None      # the template's tools: counted as a request's prompt


class DetokenizeOnly(msgspec.Struct, tag=True):
    """/detokenize: token ids back to text."""
    req_id: str
    token_ids: list[int]


TokenizerInbox = TokenizeRequest | TokenizePiece | TokenizeOnly | DetokenizeOnly
