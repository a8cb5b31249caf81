"""The offline API's prompts as callers give them (llm.py, llm_pooling.py): one prompt or a
list, per-prompt options, text / token ids / {"prompt" | "prompt_token_ids",
"multi_modal_data"} dicts and chat messages set on the TokenizeRequest, images as files, and
a streamed prompt's pieces (StreamingInput)."""
from __future__ import annotations

import io
from dataclasses import dataclass

from pagewire.wire.to_tokenizer import ChatMessage, TokenizeRequest

Prompt = str | list[int] | dict


@dataclass
class StreamingInput:
    """One piece of a streamed prompt (LLM.generate_streaming): text (encoded on its own,
    without special tokens) or token ids."""
    prompt: str | list[int]


def piece_prompt(piece):
    """A streamed piece's text or token ids (a StreamingInput's, or the piece itself)."""
    return piece.prompt if isinstance(piece, StreamingInput) else piece


def listed(prompts) -> list:
    """One prompt (text, token ids, or a dict) as a list of one; a list of prompts as is."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def per_prompt(value, n: int, what: str, default=None) -> list:
    """One value for each of n prompts: a list as given (of length n), else value (or the
    default) for every prompt."""
    values = value if isinstance(value, list) else [value or default] * n
    if len(values) != n:
        raise ValueError(f"{n} prompts but {len(values)} {what}")
    return values


def set_prompt(req: TokenizeRequest, prompt: Prompt | None,
               messages: list[dict] | None) -> None:
    """Put the prompt on req: chat messages, or text, or token ids; a dict's images too."""
    if isinstance(prompt, dict):        # {"prompt" | "prompt_token_ids", "multi_modal_data"}
        req.images = image_files(prompt.get("multi_modal_data"))
        prompt = prompt["prompt"] if "prompt" in prompt else prompt["prompt_token_ids"]
    if messages is not None:
        req.messages = [ChatMessage(**m) for m in messages]
    elif isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids = list(prompt)


def image_files(data: dict | None) -> list[bytes]:
    """multi_modal_data's images as files: PIL images saved as PNG, bytes as given."""
    if not data:
        return []
    unknown = set(data) - {"image"}
    if unknown:
        raise ValueError(f"multi_modal_data: only images are taken, not {sorted(unknown)}")
    images = data["image"] if isinstance(data["image"], list) else [data["image"]]
    out = []
    for image in images:
        if isinstance(image, (bytes, bytearray)):
            out.append(bytes(image))
        else:                                   # a PIL image
            buffer = io.BytesIO()
            image.save(buffer, format="PNG")
            out.append(buffer.getvalue())
    return out
