"""gpt-oss's output ("harmony"), split into reasoning and content (--reasoning-parser
openai_gptoss, as vLLM's parser of that name): the output is messages

    <|channel|>analysis<|message|>REASONING<|end|>
    <|start|>assistant<|channel|>final<|message|>CONTENT<|return|>

(one text, broken here for the page), each a header (`<|start|>assistant`, `<|channel|>` and
the channel's name, maybe a recipient and `<|constrain|>json`) up to `<|message|>`, then its
body up to `<|end|>`, `<|return|>` or `<|call|>`. The final channel's bodies are the content;
every other channel's (analysis, commentary) the reasoning, a message's body after another's
joined by a newline. The markers are special tokens: the gateway has such outputs detokenized
with them kept.

HarmonySplit takes the text in pieces and gives each piece's (reasoning, content) as soon as
it is certain, holding back only a header and what may be the start of a body's end marker;
split() is the same over a whole text. A text that never reaches the final channel is all
reasoning: a body cut short, and a text with no marker at all (a model not writing harmony).

With tool calls read (--tool-call-parser openai, as vLLM's), a message whose header names a
function recipient (`to=functions.NAME`, in the commentary channel) is a call: its body, the
arguments' JSON, ends at `<|call|>` and becomes a ToolCall instead of reasoning.
"""
from __future__ import annotations

import re

import msgspec

from .tools import ToolCall

CHANNEL, MESSAGE = "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
FINAL = "final"
# the tokens where a constraint (structured output) starts: the final channel's body
FINAL_START = CHANNEL + FINAL + MESSAGE


def keep_markers(sampling, parser: str | None):
    """A chat request's SamplingParams as the detokenizer must see them for `parser`: with
    openai_gptoss, special tokens kept in the text (the markers this module reads; the
    client sees none of them, reasoning and content are their bodies)."""
    if parser != "openai_gptoss" or not sampling.skip_special_tokens:
        return sampling
    return msgspec.structs.replace(sampling, skip_special_tokens=False)


def safe_prefix(text: str, marker: str) -> int:
    """How much of `text` cannot be the start of `marker` cut off at its end."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def recipient_of(header: str) -> str | None:
    """The function a header addresses (`to=functions.NAME`), or None."""
    match = _RECIPIENT.search(header)
    return match.group(1) if match else None


def channel_of(header: str) -> str:
    """A header's channel name: the word after `<|channel|>` ("" where it names none)."""
    _, found, rest = header.rpartition(CHANNEL)
    if not found:
        return ""
    words = rest.split("<|", 1)[0].split()
    return words[0] if words else ""


class HarmonySplit:
    def __init__(self, read_calls: bool = False):
        self.pending = ""           # a header being read, or a body's undecided tail
        self.final: bool | None = None   # the channel of the body being read; None: a header
        self.reasoned = False       # a non-final body was begun: the next one joins with \n
        self.read_calls = read_calls
        self.function: str | None = None   # the body being read is a call of this function
        self.arguments: list[str] = []     # its body so far
        self.calls: list[ToolCall] = []    # calls ended, for the caller to take

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) that `text`, appended to what came before, makes certain."""
        self.pending += text
        reasoning, content = [], []
        while True:
            if self.final is None:
                header, found, rest = self.pending.partition(MESSAGE)
                if not found:
                    break
                self.final, self.pending = channel_of(header) == FINAL, rest
                self.function = recipient_of(header) if self.read_calls else None
                if not self.final and self.function is None:
                    reasoning.append("\n" if self.reasoned else "")
                    self.reasoned = True
                continue
            ends = [(at, m) for m in ENDS if (at := self.pending.find(m)) >= 0]
            cut = min(ends)[0] if ends else min(safe_prefix(self.pending, m) for m in ENDS)
            body = self.pending[:cut]
            (self.arguments if self.function is not None else
             content if self.final else reasoning).append(body)
            if not ends:
                self.pending = self.pending[cut:]
                break
            self.pending, self.final = self.pending[cut + len(min(ends)[1]):], None
            self._end_call()
        return "".join(reasoning), "".join(content)

    def _end_call(self) -> None:
        if self.function is not None:
            self.calls.append(ToolCall(self.function, "".join(self.arguments).strip()))
            self.function, self.arguments = None, []

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output: a body's tail as its channel's; a
        header with no marker in it (text outside harmony) as reasoning, else nothing."""
        rest, self.pending = self.pending, ""
        if self.final is None:
            return ("" if "<|" in rest else rest), ""
        if self.function is not None:       # a call cut short (the length limit): as written
            self.arguments.append(rest)
            self._end_call()
            return "", ""
        return ("", rest) if self.final else (rest, "")


def split(text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, content); reasoning None where no message but the final
    channel's was begun and no text lies outside the messages."""
    reasoning, content, _ = parts(text, read_calls=False)
    return reasoning, content


def parts(text: str, read_calls: bool) -> tuple[str | None, str, list[ToolCall]]:
    """split() and, where `read_calls`, the function calls the output makes."""
    harmony = HarmonySplit(read_calls)
    reasoning, content = harmony.feed(text)
    more, more_content = harmony.finish()
    reasoning, content = reasoning + more, content + more_content
    return (reasoning if harmony.reasoned or reasoning else None), content, harmony.calls
