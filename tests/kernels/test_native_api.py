"""The native contract's one declaration (kernels/csrc/pagewire_api.h): what Python reads from
it, the check at load against each built library, and the mismatches that check and the
compiler catch."""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess

import pytest

from pagewire.executor.models.program import Op
from pagewire.kernels import gguf_blocks, kv_quant, lora, moe, native, native_api, quant

CSRC = os.path.join(os.path.dirname(native_api.__file__), "csrc")


def _header() -> str:
    with open(native_api.HEADER) as f:
        return f.read()


def _planted(old: str, new: str) -> native_api.Api:
    """The contract of a copy of the header with `old` replaced by `new` (once)."""
    text = _header()
    assert text.count(old) == 1, old
    return native_api.parse(text.replace(old, new))


@pytest.fixture
def raw_library(tier):
    """That tier's built library, loaded without the check (native.load makes it)."""
    if native.load(tier) is None:
        pytest.skip("no C++ compiler for the native kernels")
    return ctypes.CDLL(native.library_path(tier))


def test_the_python_codes_are_the_headers():
    assert {op.name: op.value for op in Op} == {
        "ADD_NORM": 1, "NORM": 2, "LINEAR": 3, "QK_NORM": 4, "ROPE": 5, "ATTEND": 6,
        "SILU_MUL": 7, "GELU_MUL": 8, "ALL_REDUCE": 9, "QK_NORM_FLAT": 10, "MOE": 11,
        "ADD_LAYER_NORM": 12, "BRANCH_LAYER_NORM": 13, "JOIN": 14, "GELU": 15, "GELU_TANH": 16}
    assert {w.name: w.value for w in moe.MoeWord} == {
        "EXPERTS": 0, "TOP_K": 1, "NORMALIZE": 2, "HIDDEN": 3, "INTER": 4, "ROUTER": 5,
        "SHARED_GATE_UP": 6, "SHARED_DOWN": 7, "SHARED_GATE": 8, "SHARED_INTER": 9,
        "READS": 10, "ROUTER_BIAS": 11, "TOPK_SOFTMAX": 12, "SWIGLU_OAI": 13,
        "SWIGLU_ALPHA": 14, "SWIGLU_LIMIT": 15, "SHARED_GATE_UP_SLOT": 16,
        "SHARED_DOWN_SLOT": 17, "EXPERT_TABLES": 18}
    assert moe.MoeWord.EXPERT_WORDS == 6          # a count (SHARED_GATE_UP's value: an alias)
    assert quant.KINDS == (3, 8, 12, 13, 14, 10, 90, 20, 39, 60, 62, 63, 64, 73, 74,
                           103, 108, 112, 113, 114, 110, 120, 139, 160, 162, 163, 164, 173, 174,
                           203, 208, 212, 213, 214, 210, 220, 239, 260, 262, 263, 264, 273, 274,
                           303, 312, 362, 175, 176, 30)
    assert (quant.FP8, quant.BF16) == (90, 30)
    assert kv_quant.KINDS == {kv_quant.torch.int8: 0, kv_quant.torch.float8_e4m3fn: 1,
                              kv_quant.torch.float8_e5m2: 2} and kv_quant.PLAIN == -1
    assert list(lora.KINDS.values()) == [0, 1, 2] and lora.ENTRY == 6


def test_tile_types_are_the_ggml_type_ids_gguf_blocks_reads():
    tiles = native_api.API.enums["PwTile"]
    assert {name: tiles[name] for name in ("Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q5_K", "Q6_K")} == \
        {name: getattr(gguf_blocks, name) for name in ("Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q5_K",
                                                       "Q6_K")}


def test_each_entry_point_is_read_with_its_signature():
    functions = native_api.API.functions
    assert len(functions) == 41
    assert functions["pw_moe_bf16"].signature == "vppipppi"
    assert functions["pw_moe_partial_bf16"].signature == "vppipppi"
    assert functions["pw_apply_sinks_f32"].signature == "vpppiii"
    assert functions["pw_rope_bf16"].signature == "vpippiii"
    assert functions["pw_rope_partial_bf16"].signature == "vpippiiii"
    assert functions["pw_add_layer_norm_f32"].signature == "vpppppiiif"
    assert functions["pw_decode_attention_q8_f32"].signature == "vppppppiiiiiiiififip"
    assert functions["pw_int16_mac_ratio"].signature == "di"
    assert functions["pw_api_entry"].restype == "const char*"


def test_every_tier_exports_exactly_the_declared_entry_points(raw_library):
    """The library's table (compiled from the header) reads every signature as the parser does,
    and nm lists no pw_ symbol the header does not declare."""
    assert native_api.library_table(raw_library) == {
        name: f.signature for name, f in native_api.API.functions.items()}
    if shutil.which("nm") is None:
        pytest.skip("no nm")
    out = subprocess.run(["nm", "-D", "--defined-only", raw_library._name], check=True,
                         capture_output=True, text=True).stdout
    exported = {line.split()[-1] for line in out.splitlines() if line.split()[-1][:3] == "pw_"}
    assert exported == set(native_api.API.functions)


def test_a_planted_wrong_arity_fails_the_check_at_load(raw_library):
    api = _planted("int64_t tokens, int64_t heads, int64_t D))\nPW_API(void, pw_rope_bf16",
                   "int64_t tokens, int64_t heads))\nPW_API(void, pw_rope_bf16")
    assert api.functions["pw_rope_f32"].signature == "vpippii"
    with pytest.raises(native_api.ContractError,
                       match=r"disagree on pw_rope_f32 \(library vpippiii, header vpippii\)$"):
        native_api.bind(raw_library, api)
    assert native_api.bind(raw_library).pw_decode_stack_arity(int(Op.LINEAR)) == 5


def test_a_planted_wrong_type_or_a_missing_function_fails_the_check(raw_library):
    api = _planted("int64_t x_stride, float eps))\nPW_API(void, pw_add_rms_norm_bf16",
                   "int64_t x_stride, double eps))\nPW_API(void, pw_add_rms_norm_bf16")
    with pytest.raises(native_api.ContractError, match=r"pw_add_rms_norm_f32 \(library "
                                                         r"vppppiiif, header vppppiiid\)"):
        native_api.bind(raw_library, api)
    api = _planted("#undef PW_API", "PW_API(void, pw_not_built, (int64_t n))\n#undef PW_API")
    with pytest.raises(native_api.ContractError, match="lacks declared entry points: "
                                                       "pw_not_built$"):
        native_api.bind(raw_library, api)


def test_calls_take_exactly_the_declared_arguments(native_lib):
    arity = native_lib.cdll.pw_decode_stack_arity
    assert arity(int(Op.ATTEND)) == 12 and arity(int(Op.MOE)) == 1
    assert arity(int(Op.GELU_MUL)) == -1
    with pytest.raises(TypeError, match=r"takes 1 argument \(2 given\)"):
        arity(int(Op.ATTEND), 0)
    with pytest.raises(TypeError, match=r"takes 1 argument \(0 given\)"):
        arity()
    with pytest.raises(ctypes.ArgumentError):
        arity(1.5)
    with pytest.raises(AttributeError):
        native_lib.cdll.pw_undeclared


@pytest.mark.parametrize("text, error", [
    ("PW_API(void, pw_x, (int n))", r"pw_x: parameter type 'int' is none of"),
    ("PW_API(float*, pw_x, ())", r"pw_x: return type 'float\*' is none of"),
    ("void pw_x(int64_t n);", r"text outside its format: 'void pw_x\(int64_t n\);'"),
    ("enum PwMode : int64_t { PW_OTHER_A = 1 };", r"enum PwMode: cannot read 'PW_OTHER_A = 1'"),
])
def test_the_reader_rejects_what_is_outside_the_format(text, error):
    with pytest.raises(native_api.ContractError, match=error):
        native_api.parse(_header() + "\n" + text + "\n")


def _syntax_check(tmp_path, definition: str) -> subprocess.CompletedProcess:
    source = tmp_path / "definition.cpp"
    source.write_text(f'#include "pagewire_api.h"\n{definition}\n')
    return subprocess.run([os.environ.get("CXX", "g++"), "-std=c++17", "-fsyntax-only",
                           f"-I{CSRC}", str(source)], capture_output=True, text=True)


def test_a_definition_that_differs_from_its_declaration_does_not_compile(tmp_path):
    if shutil.which(os.environ.get("CXX", "g++")) is None:
        pytest.skip("no C++ compiler")
    params = "(float* out, const float* gate_up, int64_t tokens, int64_t inter)"
    assert _syntax_check(tmp_path, f'extern "C" void pw_silu_and_mul_f32{params} {{}}'
                         ).returncode == 0
    wrong = _syntax_check(tmp_path, 'extern "C" void pw_silu_and_mul_f32(float* out, '
                                    'const float* gate_up, int64_t tokens) {}')
    assert wrong.returncode != 0 and "conflicting declaration" in wrong.stderr


def test_every_source_with_entry_points_includes_the_header_and_redeclares_none():
    for name in sorted(os.listdir(CSRC)):
        if not name.endswith(".cpp"):
            continue
        with open(os.path.join(CSRC, name)) as f:
            text = f.read()
        assert '#include "pagewire_api.h"' in text or 'extern "C"' not in text, name
        # an extern "C" line ending its parameters with ");" declares rather than defines
        assert not re.search(r'extern "C"[^{;]*\)\s*;', text), name
        assert not re.search(r"^\s*(void|int64_t|double)\s+pw_\w+\([^{]*\);", text, re.M), name


def test_every_header_versions_the_library():
    """A header the build reads but the library's hash leaves out would keep a stale build."""
    import os
    csrc = os.path.join(os.path.dirname(native.__file__), "csrc")
    assert {os.path.basename(h) for h in native._HEADERS} == \
        {f for f in os.listdir(csrc) if f.endswith(".h")}
