"""The calls of a `required` tool choice read from the JSON list the grammar holds the output
to, `[{"name": NAME, "parameters": ARGS}, ...]` (tools.py writes the schema; llguidance keeps
a schema's property order, so a call's name always comes before its arguments), as the text
streams in: each call is reported once its name is known and its arguments grow piece by
piece, so a list cut short (max_tokens) still reports the calls it began.

The grammar has already checked the text, so reading it needs no validation: only where each
call's name and arguments begin and end.
"""
from __future__ import annotations

import json
import re

import msgspec


class ToolCall(msgspec.Struct):
    name: str
    arguments: str              # JSON text (its beginning, where the output was cut short)


# From a call's opening ([ or , then {) to the first character of its arguments.
_HEAD = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"parameters"\s*:')
_TAIL = re.compile(r"\s*\}")                 # a call object's end, after its arguments
_END = re.compile(r"\s*\]")                  # the list's end
_BEGUN = re.compile(r'\s*[\[,]')             # a call begun (the list has at least one)
_NAME_SO_FAR = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)(")?')


class CallList:
    def __init__(self, functions: list[str]):
        self.functions = functions   # the tools' names: a name cut short may still tell one
        self.calls: list[ToolCall] = []
        self.text, self.pos = "", 0  # all the text fed, and how far it is read
        self.state = "head"          # head | args | tail | end
        self.depth, self.in_string, self.escape, self.begun = 0, False, False, False

    def feed(self, text: str) -> dict[int, list]:
        """{call index: [whether it is new, the arguments' text added]} for what `text` adds."""
        self.text += text
        added: dict[int, list] = {}
        while self.state != "end":
            if self.state == "args":
                piece = self._arguments()
                if piece:
                    added.setdefault(len(self.calls) - 1, [False, ""])[1] += piece
                    self.calls[-1].arguments += piece
                if self.state == "args":
                    break
            elif not self._structure(added):
                break
        return added

    def finish(self) -> dict[int, list]:
        """What feed() gives, and a call whose name was cut short where the tools' names
        leave one it can be (its arguments empty)."""
        if self.state != "head" or not _BEGUN.match(self.text, self.pos):
            return {}
        seen = _NAME_SO_FAR.search(self.text, self.pos)
        so_far = seen.group(1) if seen else ""
        if seen and seen.group(2):
            names = [json.loads(f'"{so_far}"')]
        else:
            names = [n for n in self.functions if n.startswith(so_far)]
        if len(names) != 1:
            return {}
        self.calls.append(ToolCall(names[0], ""))
        self.state = "end"
        return {len(self.calls) - 1: [True, ""]}

    def _structure(self, added: dict[int, list]) -> bool:
        """Reads a call's head, a call's tail or the list's end; False: not all here yet."""
        if self.state == "tail":
            found = _TAIL.match(self.text, self.pos)
            next_state = "head"
        else:
            found = _END.match(self.text, self.pos)
            next_state = "end"
            if not found:
                found = _HEAD.match(self.text, self.pos)
                next_state = "args"
                if found:
                    self.calls.append(ToolCall(json.loads(found.group(1)), ""))
                    added[len(self.calls) - 1] = [True, ""]
                    self.depth, self.in_string, self.escape, self.begun = 0, False, False, False
        if found:
            self.pos, self.state = found.end(), next_state
        return bool(found)

    def _arguments(self) -> str:
        """The arguments' text from pos up to their end or the text's; at their end, state
        becomes tail. Leading whitespace is the list's, not the arguments'."""
        start = i = self.pos
        while i < len(self.text):
            c = self.text[i]
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return self._ended(start, i + 1)
            elif c == '"':
                self.in_string = self.begun = True
            elif c in "{[":
                self.depth, self.begun = self.depth + 1, True
            elif c in "}]" or (c in ", \t\r\n" and self.depth == 0):
                if self.depth == 0:
                    if self.begun:           # a number, true, false or null ended
                        return self._ended(start, i)
                    start += 1               # whitespace before the arguments
                else:
                    self.depth -= 1
                    if self.depth == 0:
                        return self._ended(start, i + 1)
            else:
                self.begun = True
            i += 1
        self.pos = i
        return self.text[start:i]

    def _ended(self, start: int, end: int) -> str:
        self.pos, self.state = end, "tail"
        return self.text[start:end]
