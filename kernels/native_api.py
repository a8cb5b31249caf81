"""The native library's contract, read from its one declaration: csrc/pagewire_api.h.

The header declares every exported entry point (PW_API lines) and every integer code the
Python and C++ sides exchange (its enums). This module parses it (its format is the header's
own comment; anything else in it is an error, so nothing is skipped silently) into
- `API.functions`: each entry point's return and parameter types, from which `bind` makes
  the ctypes functions (exact argument counts: a call with one argument too many raises
  TypeError instead of passing it on);
- `API.enums`: the codes, as IntEnums (program.Op, the tile kinds of quant.py, ...).
The header is read at import, not copied into a generated module: there is nothing to
regenerate and nothing to go stale. `bind` checks at load that the library has every
declared function and that its own table (csrc/api_table.cpp, compiled from the same header)
reads each signature as this parser does.
"""
from __future__ import annotations

import ctypes
import enum
import os
import re
from dataclasses import dataclass

HEADER = os.path.join(os.path.dirname(__file__), "csrc", "pagewire_api.h")

# A type's code (api_table.cpp's) and its ctypes type, for each type the header may use.
_VALUES = {"int64_t": ("i", ctypes.c_int64), "float": ("f", ctypes.c_float),
           "double": ("d", ctypes.c_double)}
_POINTER = ("p", ctypes.c_void_p)
_RETURNS = {"void": ("v", None), **_VALUES, "const char*": ("p", ctypes.c_char_p)}

_COMMENT = re.compile(r"//[^\n]*")
_PREPROCESSOR = re.compile(r"^[ \t]*#[^\n]*", re.M)
_TYPEDEF = re.compile(r"typedef\s+uint16_t\s+pw_bf16\s*;")
_ENUM = re.compile(r"enum\s+(Pw\w+)\s*:\s*int64_t\s*\{([^}]*)\}\s*;")
_MEMBER = re.compile(r"\s*(\w+)\s*=\s*(-?\d+)\s*")
_FUNCTION = re.compile(r"PW_API\(\s*([\w ]+\*?)\s*,\s*(pw_\w+)\s*,\s*\(([^()]*)\)\s*\)")
_PARAM = re.compile(r"(?:const\s+)?\w+\s*\*\s*(\w+)|(\w+)\s+(\w+)")


class ContractError(RuntimeError):
    """The header, the library or a caller disagree about the contract."""


@dataclass(frozen=True)
class Function:
    name: str
    restype: str              # the C return type, as declared
    params: tuple[str, ...]   # each parameter's C type, normalized ("T*" for any pointer)

    @property
    def signature(self) -> str:
        """api_table.cpp's codes: the return type's, then each parameter's."""
        return _RETURNS[self.restype][0] + "".join(
            _POINTER[0] if p.endswith("*") else _VALUES[p][0] for p in self.params)

    def prototype(self):
        """The ctypes function type: these argtypes and restype, and no extra arguments (a
        CDLL function's CDECL flag lets a call pass more than argtypes; flags 0 is the same
        call on every non-Windows ABI, with the count checked)."""
        argtypes = tuple(_POINTER[1] if p.endswith("*") else _VALUES[p][1] for p in self.params)
        return type(self.name, (ctypes._CFuncPtr,),
                    {"_argtypes_": argtypes, "_restype_": _RETURNS[self.restype][1],
                     "_flags_": 0})


@dataclass(frozen=True)
class Api:
    functions: dict[str, Function]
    enums: dict[str, dict[str, int]]   # enum name -> {member without its prefix: value}

    def int_enum(self, name: str, python_name: str, module: str) -> type[enum.IntEnum]:
        """Enum `name` of the header as an IntEnum called `python_name` of `module`."""
        return enum.IntEnum(python_name, self.enums[name], module=module,
                            qualname=python_name)


def _param_type(text: str, where: str) -> str:
    match = _PARAM.fullmatch(text.strip())
    if match is None:
        raise ContractError(f"{where}: cannot read parameter {text.strip()!r}")
    if match.group(1) is not None:
        return "T*"
    if match.group(2) not in _VALUES:
        raise ContractError(f"{where}: parameter type {match.group(2)!r} is none of "
                            f"{', '.join(_VALUES)} or a pointer")
    return match.group(2)


def _enum_members(name: str, body: str) -> dict[str, int]:
    """PW_NAME_MEMBER = value lines -> {MEMBER: value} (the prefix: `name` in capitals)."""
    prefix = re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper() + "_"
    members = {}
    for item in filter(str.strip, body.split(",")):
        match = _MEMBER.fullmatch(item)
        if match is None or not match.group(1).startswith(prefix):
            raise ContractError(f"enum {name}: cannot read {item.strip()!r} (want "
                                f"{prefix}NAME = integer)")
        members[match.group(1)[len(prefix):]] = int(match.group(2))
    return members


def parse(text: str) -> Api:
    """The contract a header's text declares; ContractError for anything outside its format."""
    text = _PREPROCESSOR.sub("", _COMMENT.sub("", text))
    text = _TYPEDEF.sub("", text)
    enums = {m.group(1): _enum_members(m.group(1), m.group(2)) for m in _ENUM.finditer(text)}
    functions = {}
    for m in _FUNCTION.finditer(text):
        ret, name, params = " ".join(m.group(1).split()).replace(" *", "*"), m.group(2), m.group(3)
        if ret not in _RETURNS:
            raise ContractError(f"{name}: return type {ret!r} is none of {', '.join(_RETURNS)}")
        if name in functions:
            raise ContractError(f"{name} is declared twice")
        functions[name] = Function(name, ret, tuple(
            _param_type(p, name) for p in params.split(",") if params.strip()))
    rest = _FUNCTION.sub("", _ENUM.sub("", text)).strip()
    if rest:
        raise ContractError(f"pagewire_api.h: text outside its format: {rest[:80]!r}")
    return Api(functions, enums)


def read(path: str = HEADER) -> Api:
    with open(path) as f:
        return parse(f.read())


API = read()


def library_table(cdll: ctypes.CDLL) -> dict[str, str]:
    """The library's own table: entry point -> signature codes (api_table.cpp)."""
    entry = API.functions["pw_api_entry"].prototype()(("pw_api_entry", cdll))
    rows, i = {}, 0
    while (row := entry(i)) is not None:
        name, signature = row.decode().split(" ")
        rows[name], i = signature, i + 1
    return rows


class Bound:
    """A library's declared entry points as attributes, each with its prototype; a name the
    header does not declare is an AttributeError."""

    def __init__(self, functions: dict[str, object]):
        self.__dict__.update(functions)


def bind(cdll: ctypes.CDLL, api: Api = API) -> Bound:
    """`api`'s functions of `cdll`, after checking the library agrees with `api`: it has
    every declared function and its table gives each the same signature, and no more."""
    missing = [name for name in api.functions if not hasattr(cdll, name)]
    if missing:
        raise ContractError(f"the library lacks declared entry points: {', '.join(missing)}")
    table = library_table(cdll)
    ours = {name: f.signature for name, f in api.functions.items()}
    if table != ours:
        differ = sorted(name for name in table.keys() | ours.keys()
                        if table.get(name) != ours.get(name))
        raise ContractError("the library's table and pagewire_api.h as read disagree on " +
                            ", ".join(f"{n} (library {table.get(n)}, header {ours.get(n)})"
                                      for n in differ))
    return Bound({name: f.prototype()((name, cdll)) for name, f in api.functions.items()})
