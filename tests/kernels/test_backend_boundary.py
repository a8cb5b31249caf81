"""The backend boundary (kernels/ops.py, executor/backend.py): code outside the backend never
branches on a CPU tier, a device type or a backend name. It asks the backend's capabilities
(kernels/ops.py Capabilities) instead, so a new tier or device is one backend, not an edit
in the runner, the loader, the model or the sampler.

The test walks the syntax trees of actors/ and kernels/ (less the backend's own modules) for
comparisons with such a name (`ops.name == "cpu"`, `device.type != "cuda"`, `kernels in
("cpu", "avx2")`, `x in tiers.TIERS`, `lib.tier == "avx2"`); the few places that must keep
one are listed below, each with why."""
from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# The backend: the only modules that may name a tier, device type or backend.
BACKEND = {"kernels/ops.py", "kernels/tiers.py", "kernels/native.py", "kernels/triton_ops.py"}
NAMES = {"avx2", "avx512", "avx512_bf16", "amx", "cpu", "cuda", "mps", "xpu", "triton", "torch",
         "native"}
NAME_LISTS = {"TIERS", "BACKENDS", "ALIASES"}           # kernels/tiers.py's lists of them
EQUALITY = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)
# (file, enclosing function): why it may compare a device or backend name. Keep it short.
EXCEPTIONS = {
    # the configuration resolves --device before any actor imports torch (no backend yet)
    ("actors/config.py", "EngineConfig._on_cuda"): "--device auto: a GPU driver present",
    ("actors/config.py", "EngineConfig._device"): "refuses --device cuda with a CPU tier",
    # a Triton kernel's launch grid: the GPU's SM count, or a stand-in under the interpreter
    ("kernels/attention_triton.py", "_sm_count"): "the SM count of a CUDA device",
}


def _names_a_backend(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return node.value in NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_names_a_backend(e) for e in node.elts)
    if isinstance(node, ast.Starred):
        return _names_a_backend(node.value)
    if isinstance(node, ast.Attribute):              # lib.tier, tiers.TIERS
        return node.attr == "tier" or node.attr in NAME_LISTS
    return False


def _branches(tree: ast.Module):
    """(enclosing function's qualified name, line, source) of each comparison of a value
    with a tier, device type or backend name (`is None` tests of a `.tier` are not one)."""
    def walk(node, scope):
        for child in ast.iter_child_nodes(node):
            inner = scope
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = f"{scope}.{child.name}" if scope else child.name
            if isinstance(child, ast.Compare) and any(isinstance(op, EQUALITY)
                                                      for op in child.ops) \
                    and any(map(_names_a_backend, [child.left, *child.comparators])):
                yield scope, child.lineno, ast.unparse(child)
            yield from walk(child, inner)
    yield from walk(tree, "")


def _outside_the_backend():
    for folder in ("actors", "kernels"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in BACKEND:
                yield rel, ast.parse(path.read_text(), rel)


def test_no_code_outside_the_backend_branches_on_a_tier_device_or_backend_name():
    found = [f"{rel}:{line} in {scope or '<module>'}: {src}"
             for rel, tree in _outside_the_backend()
             for scope, line, src in _branches(tree) if (rel, scope) not in EXCEPTIONS]
    assert found == [], "ask the backend's capabilities (kernels/ops.py) instead:\n" + \
        "\n".join(found)


def test_every_listed_exception_still_branches():
    """An exception whose branch went away is dropped from the list, so it stays short."""
    used = {(rel, scope) for rel, tree in _outside_the_backend()
            for scope, _, _ in _branches(tree)}
    assert set(EXCEPTIONS) - used == set()


# What the runner used to set on a model from outside; the model now takes its kernels and
# context-parallel group at construction and its fused program from the backend's
# prepare_caches (use_fused_decode), and load returns the rounded blocks beside the model.
# Its linears' LoRA slots it numbers itself (models/lora_slots.py).
MODEL_STATE = {"ops", "fused_decode", "cp", "rounded_blocks", "huge_page_arena", "lora_slot"}


def test_nothing_sets_a_models_kernels_or_programs_from_outside():
    found = []
    for rel, tree in _outside_the_backend():
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            targets = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            found += [f"{rel}:{node.lineno}: {ast.unparse(t)}" for t in targets
                      if isinstance(t, ast.Attribute) and t.attr in MODEL_STATE
                      and not (isinstance(t.value, ast.Name) and t.value.id == "self")]
    assert found == []


def test_the_walk_finds_the_branches_it_forbids():
    """The check itself: each spelling it is meant to catch is caught, a KV tier's None test
    is not."""
    source = '''
def f(ops, device, lib, kernels, tiers, plan):
    a = ops.name == "cpu"
    b = device.type != "cuda"
    c = lib.tier == "avx2"
    d = kernels in ("cpu", "avx512_bf16")
    e = kernels not in tiers.TIERS
    g = plan.tier is not None
'''
    found = [src for _, _, src in _branches(ast.parse(source))]
    assert found == ["ops.name == 'cpu'", "device.type != 'cuda'", "lib.tier == 'avx2'",
                     "kernels in ('cpu', 'avx512_bf16')", "kernels not in tiers.TIERS"]
