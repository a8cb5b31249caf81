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
"""
from __future__ import annotations

import msgspec

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


def channel_of(header: str) -> str:
    """A header's channel name: the word after `<|channel|>` ("" where it names none)."""
    _, found, rest = header.rpartition(CHANNEL)
    if not found:
        return ""
    words = rest.split("<|", 1)[0].split()
    return words[0] if words else ""


class HarmonySplit:
    def __init__(self):
        self.pending = ""           # a header being read, or a body's undecided tail
        self.final: bool | None = None   # the channel of the body being read; None: a header
        self.reasoned = False       # a non-final body was begun: the next one joins with \n

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
                if not self.final:
                    reasoning.append("\n" if self.reasoned else "")
                    self.reasoned = True
                continue
            ends = [(at, m) for m in ENDS if (at := self.pending.find(m)) >= 0]
            cut = min(ends)[0] if ends else min(safe_prefix(self.pending, m) for m in ENDS)
            (content if self.final else reasoning).append(self.pending[:cut])
            if not ends:
                self.pending = self.pending[cut:]
                break
            self.pending, self.final = self.pending[cut + len(min(ends)[1]):], None
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held, at the end of the output: a body's tail as its channel's; a
        header with no marker in it (text outside harmony) as reasoning, else nothing."""
        rest, self.pending = self.pending, ""
        if self.final is None:
            return ("" if "<|" in rest else rest), ""
        return ("", rest) if self.final else (rest, "")


def split(text: str) -> tuple[str | None, str]:
    """A whole output's (reasoning, content); reasoning None where no message but the final
    channel's was begun and no text lies outside the messages."""
    parts = HarmonySplit()
    reasoning, content = parts.feed(text)
    more, more_content = parts.finish()
    reasoning, content = reasoning + more, content + more_content
    return (reasoning if parts.reasoned or reasoning else None), content
