"""Traces: every frame an actor's channels send or receive, with timestamps, in its own file.

A trace file is MAGIC, then a length-prefixed msgpack TraceHeader, then length-prefixed msgpack
TraceRecords (u32 little-endian length before each). Files are written 0600 in a 0700
directory; each actor rotates its own segments by size and keeps the newest `max_segments`, so
the disk use is bounded. A file cut short (the process killed mid-write) reads up to its last
whole record, with a warning.

Recording can be switched at run time: a writer records only while the directory holds the
flag file ENABLED_FLAG (checked at most once a second).
"""
from __future__ import annotations

import glob
import os
import struct
import time
import warnings
from collections.abc import Iterator

import msgspec

FORMAT_VERSION = 2          # 2: StepResult in per-feature sections (1: flat, trace_v1.py)
READABLE_VERSIONS = (1, 2)
MAGIC = b"PWTRACE\x00"
ENABLED_FLAG = "recording"
_LEN = struct.Struct("<I")


class TraceHeader(msgspec.Struct, kw_only=True):
    version: int
    actor: str
    pid: int
    segment: int
    config_digest: str          # what the engine ran with (see EngineConfig digest)
    model_id: str               # the model's name and weights digest
    config_json: str            # the configuration itself, API keys removed: replay uses it
    started: float = 0.0        # time.time() when this actor's trace began
    redacted: bool = False
    gap: bool = False           # messages before this segment went unrecorded (switched off)


class TraceRecord(msgspec.Struct, array_like=True, gc=False):
    mono: float                 # time.monotonic() in the recording process
    wall: float                 # time.time()
    direction: str              # "in" | "out"
    channel: str                # the inbox the frame went to or came from: "scheduler", ...
    frame: bytes                # the message exactly as it crossed (or redacted, see header)


_record_encoder = msgspec.msgpack.Encoder()


class TraceWriter:
    """One actor's trace: appends records, rotates segments, honours the on/off flag."""

    def __init__(self, directory: str, header: TraceHeader, segment_bytes: int = 64 * 2**20,
                 max_segments: int = 8):
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self.directory, self.header = directory, header
        self.segment_bytes, self.max_segments = segment_bytes, max_segments
        self.stem = f"{header.actor.replace(' ', '-')}.{header.pid}"
        self.file = None
        self.size = 0
        self.skipped = 0            # messages not recorded while switched off
        self._enabled, self._checked = False, 0.0
        self._open(0)

    @property
    def enabled(self) -> bool:
        now = time.monotonic()
        if now - self._checked >= 1.0:
            self._checked = now
            self._enabled = os.path.exists(os.path.join(self.directory, ENABLED_FLAG))
        return self._enabled

    def record_message(self, direction: str, channel: str, msg: msgspec.Struct,
                       frame: bytes) -> None:
        """Record a message as it crossed, or its redacted form when the trace redacts."""
        if not self.enabled:
            self.skipped += 1
            return
        if self.header.redacted:
            frame = msgspec.msgpack.encode(redact(msg))
        data = _record_encoder.encode(TraceRecord(time.monotonic(), time.time(), direction,
                                                  channel, bytes(frame)))
        if self.skipped:            # switched back on: a new segment says what is missing
            self.skipped = 0
            self._open(self.header.segment + 1, gap=True)
        elif self.size + len(data) > self.segment_bytes:
            self._open(self.header.segment + 1)
        self.file.write(_LEN.pack(len(data)) + data)
        self.size += _LEN.size + len(data)

    def flush(self) -> None:
        if self.file is not None:
            self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    def _open(self, segment: int, gap: bool = False) -> None:
        self.close()
        self.header.segment, self.header.gap = segment, gap
        path = os.path.join(self.directory, f"{self.stem}.{segment:05d}.pwtrace")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        self.file = os.fdopen(fd, "wb", buffering=1 << 16)
        head = msgspec.msgpack.encode(self.header)
        self.file.write(MAGIC + _LEN.pack(len(head)) + head)
        self.size = len(MAGIC) + _LEN.size + len(head)
        mine = sorted(glob.glob(os.path.join(self.directory, f"{self.stem}.*.pwtrace")))
        for old in mine[:-self.max_segments]:         # oldest first: never a full disk
            os.remove(old)


# Fields that carry a user's words: text is replaced by as many block characters, token ids by
# as many zeros, so counts, lengths and timing survive and the content does not.
_TEXT_FIELDS = frozenset({"prompt", "content", "text", "stop", "echo_prompt", "token",
                          "bad_words", "token_strs", "top"})
_TOKEN_FIELDS = frozenset({"prompt_token_ids", "token_ids", "prompt_tail", "top_ids",
                           "new_token_ids", "allowed_token_ids", "bad_words_ids",
                           "first_prompt_token", "token_id", "top"})
# Images a user sent (files, prepared pixels): as many zero bytes.
_BYTES_FIELDS = frozenset({"images", "pixels"})


def redact(value, field: str = ""):
    """A copy of a message with prompts, outputs and token ids blanked (structure kept)."""
    if isinstance(value, msgspec.Struct):
        return msgspec.structs.replace(value, **{
            f: redact(getattr(value, f), f) for f in value.__struct_fields__})
    if isinstance(value, str):
        return "\u2588" * len(value) if field in _TEXT_FIELDS else value
    if isinstance(value, bytes):
        return bytes(len(value)) if field in _BYTES_FIELDS else value
    if isinstance(value, int) and not isinstance(value, bool):
        return 0 if field in _TOKEN_FIELDS else value
    if isinstance(value, (list, tuple)):
        out = [redact(v, field) for v in value]
        return out if isinstance(value, list) else tuple(out)
    if isinstance(value, dict):
        return {k: redact(v, field) for k, v in value.items()}
    return value


def read_trace(path: str) -> tuple[TraceHeader, Iterator[TraceRecord]]:
    """The header and the records of one trace file. Raises ValueError for a file that is not
    a trace; a cut-short or corrupt tail ends the records with a warning."""
    with open(path, "rb") as f:
        data = f.read()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a pagewire trace")
    pos = len(MAGIC)
    (n,) = _LEN.unpack_from(data, pos)
    header = msgspec.msgpack.decode(data[pos + _LEN.size: pos + _LEN.size + n], type=TraceHeader)
    if header.version not in READABLE_VERSIONS:
        raise ValueError(f"{path}: trace format {header.version}, this reader knows "
                         f"{', '.join(map(str, READABLE_VERSIONS))}")
    pos += _LEN.size + n
    return header, _records(path, data, pos)


def _records(path: str, data: bytes, pos: int) -> Iterator[TraceRecord]:
    decoder = msgspec.msgpack.Decoder(TraceRecord)
    count = 0
    while pos < len(data):
        if pos + _LEN.size > len(data):
            break
        (n,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + n
        if end > len(data):
            break
        try:
            yield decoder.decode(data[pos + _LEN.size:end])
        except msgspec.DecodeError:
            break
        pos, count = end, count + 1
    if pos < len(data):
        warnings.warn(f"{path}: cut short or corrupt after record {count} (byte {pos} of "
                      f"{len(data)}); read {count} whole records", stacklevel=2)


def set_recording(directory: str, on: bool) -> bool:
    """Switch every actor's recording into `directory` on or off (each notices within a
    second); returns whether it is on now."""
    flag = os.path.join(directory, ENABLED_FLAG)
    if on:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        os.close(os.open(flag, os.O_WRONLY | os.O_CREAT, 0o600))
    elif os.path.exists(flag):
        os.remove(flag)
    return os.path.exists(flag)


def trace_files(directory: str) -> list[str]:
    return sorted(glob.glob(os.path.join(directory, "*.pwtrace")))
