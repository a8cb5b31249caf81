"""One chat choice's message, from its text: a reasoning model's <think> block (or gpt-oss's
channels other than the final one: harmony.py) apart as `reasoning_content`
(--reasoning-parser), and tool calls read from what follows (tools.py).

message() shapes a finished text at once; feed() and finish() shape the same text as it
streams into OpenAI delta objects, holding back only what may still turn out to be a marker
(the end of reasoning, the start of a tool call) or a call. Both give the same message.
"""
from __future__ import annotations

from . import harmony
from .harmony import safe_prefix
from .call_list import CallList
from .tools import CALL_MARKERS, ToolPlan, calls_of, call_id, tool_call_dicts

THINK, END_THINK = "<think>", "</think>"


def split_reasoning(parser: str | None, text: str) -> tuple[str | None, str]:
    """(reasoning, content). deepseek_r1: the output starts inside the block, so a text with
    no end is all reasoning; qwen3: a block exists only where the output opens one;
    openai_gptoss: harmony.split."""
    if parser is None:
        return None, text
    if parser == "openai_gptoss":
        return harmony.split(text)
    if END_THINK not in text:
        return (text.replace(THINK, "", 1), "") if parser == "deepseek_r1" else (None, text)
    before, _, after = text.partition(END_THINK)
    if parser == "qwen3" and not before.lstrip().startswith(THINK):
        return None, text
    return before.replace(THINK, "", 1), after.lstrip("\n")


class ChatOutput:
    def __init__(self, tools: ToolPlan, reasoning_parser: str | None):
        self.tools, self.parser = tools, reasoning_parser
        # phase: "open" (qwen3: is there a block?), "reasoning", "content"; a harmony
        # output's content (openai_gptoss) is what `harmony` splits off its text
        self.phase = {"deepseek_r1": "reasoning", "qwen3": "open"}.get(reasoning_parser,
                                                                       "content")
        # openai (gpt-oss): tool calls are harmony messages of their own, read by the split
        self.harmony_calls = tools.mode == "auto" and tools.parser == "openai"
        self.harmony = harmony.HarmonySplit(self.harmony_calls) \
            if reasoning_parser == "openai_gptoss" else None
        self.calls_sent = 0        # harmony calls streamed so far (their indices)
        self.pending = ""          # text received, not yet sent or decided
        self.held = ""             # content held back as (possible) tool calls
        self.in_calls = False      # auto: a call's marker was seen; the rest is held
        self.trim = False          # drop newlines opening the content (after </think>)
        # a forced choice's calls as they stream: the named function's (its arguments are the
        # output) or those the `required` list holds
        self.forced = CallList(tools.functions) if tools.mode == "required" else None
        self.named_begun = False

    # -- whole ---------------------------------------------------------------------------------

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        if self.harmony_calls:
            reasoning, content, message_calls = harmony.parts(text, read_calls=True)
        else:
            (reasoning, content), message_calls = split_reasoning(self.parser, text), []
        msg = {"role": "assistant", "content": content}
        if self.parser is not None:
            msg["reasoning_content"] = reasoning
        if self.tools.mode != "text":
            content, calls = calls_of(self.tools, content)
            calls = message_calls + calls
            msg["content"] = content
            if calls:
                msg["tool_calls"] = tool_call_dicts(calls)
                finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return msg, finish_reason

    # -- streamed ------------------------------------------------------------------------------

    def feed(self, text: str) -> list[dict]:
        out = []
        if self.harmony is not None:
            reasoning, text = self.harmony.feed(text)
            out += _delta("reasoning_content", reasoning) + self._harmony_calls()
        self.pending += text
        if self.phase == "open":
            head = self.pending.lstrip()
            if head.startswith(THINK):
                self.phase, self.pending = "reasoning", head[len(THINK):]
            elif not THINK.startswith(head):
                self.phase = "content"
        if self.phase == "reasoning":
            before, found, after = self.pending.partition(END_THINK)
            if found:
                out += _delta("reasoning_content", before.replace(THINK, "", 1))
                self.phase, self.pending, self.trim = "content", after, True
            else:
                cut = safe_prefix(self.pending, END_THINK)
                out += _delta("reasoning_content", self.pending[:cut].replace(THINK, "", 1))
                self.pending = self.pending[cut:]
        if self.phase == "content":
            if self.trim:              # the newlines after </think> belong to neither part
                self.pending = self.pending.lstrip("\n")
                self.trim = not self.pending
            out += self._content(self.pending)
            self.pending = ""
        return out

    def _content(self, text: str) -> list[dict]:
        mode = self.tools.mode
        if mode == "text":
            return _delta("content", text)
        if mode == "named":
            return self._named_arguments(text)
        if mode == "required":
            return _call_deltas(self.forced.feed(text), self.forced)
        if self.in_calls:
            self.held += text
            return []
        text, self.held = self.held + text, ""
        marker = CALL_MARKERS[self.tools.parser]
        if marker is None:              # openai: calls are messages of their own
            return _delta("content", text)
        if marker == "{":               # llama3_json: a call is the whole output
            head = text.lstrip()
            if head.startswith(("{", "<|python_tag|>")):
                self.in_calls, self.held = True, text
                return []
            if not head:
                self.held = text
                return []
            self.tools = ToolPlan(mode="text")           # plain text after all
            return _delta("content", text)
        before, found, after = text.partition(marker)
        if found:
            self.in_calls, self.held = True, marker + after
            return _delta("content", before)
        cut = safe_prefix(text, marker)
        self.held = text[cut:]          # a marker's beginning, maybe
        return _delta("content", text[:cut])

    def _named_arguments(self, text: str, last: bool = False) -> list[dict]:
        """The named function's call: begun with its first text (or at the end, empty)."""
        if not (text or last and not self.named_begun):
            return []
        new, self.named_begun = not self.named_begun, True
        return [{"tool_calls": [_call_delta(0, new, self.tools.function, text)]}]

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The deltas still held, and the choice's finish_reason."""
        if self.harmony is None:
            return self._finish(finish_reason)
        reasoning, content = self.harmony.finish()
        self.pending += content
        out, finish_reason = self._finish(finish_reason)
        calls = self._harmony_calls()
        if self.calls_sent and finish_reason == "stop":
            finish_reason = "tool_calls"
        return _delta("reasoning_content", reasoning) + out + calls, finish_reason

    def _reported_calls(self) -> bool:
        """Whether a forced choice's stream reported a call."""
        return self.named_begun or bool(self.forced and self.forced.calls)

    def _harmony_calls(self) -> list[dict]:
        """The harmony calls ended since the last delta, each whole in one."""
        calls, self.harmony.calls = self.harmony.calls, []
        dicts = tool_call_dicts(calls)
        for d in dicts:
            d["index"], self.calls_sent = self.calls_sent, self.calls_sent + 1
        return [{"tool_calls": dicts}] if dicts else []

    def _finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        if self.phase == "open":
            self.phase = "content"
        if self.phase == "reasoning":          # cut short in it: a named call is still one
            out = _delta("reasoning_content", self.pending.replace(THINK, "", 1))
            if self.tools.mode == "named":
                out += self._named_arguments("", last=True)
            return out, finish_reason
        held, self.held = self.held + self.pending, ""
        mode = self.tools.mode
        if mode in ("named", "required"):      # forced: the output is the call(s)
            out = self._named_arguments(held, last=True) if mode == "named" else \
                _call_deltas({**self.forced.feed(held), **self.forced.finish()}, self.forced)
            return out, "tool_calls" if self._reported_calls() and finish_reason == "stop" \
                else finish_reason
        if mode == "text":
            return self._content(held) if held else [], finish_reason
        content, calls = calls_of(self.tools, held)
        out = _delta("content", content or "")
        if calls:
            out.append({"tool_calls": [dict(d, index=i) for i, d in
                                       enumerate(tool_call_dicts(calls))]})
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return out, finish_reason


def _delta(field: str, text: str) -> list[dict]:
    return [{field: text}] if text else []


def _call_deltas(added: dict[int, list], calls: CallList) -> list[dict]:
    """The tool-call deltas of what CallList.feed / finish added."""
    if not added:
        return []
    return [{"tool_calls": [_call_delta(i, new, calls.calls[i].name, piece)
                            for i, (new, piece) in sorted(added.items())]}]


def _call_delta(index: int, new: bool, name: str, arguments: str) -> dict:
    """A call's delta: its first carries the id, type and name, the rest only arguments."""
    if not new:
        return {"index": index, "function": {"arguments": arguments}}
    return {"index": index, "id": call_id(), "type": "function",
            "function": {"name": name, "arguments": arguments}}
