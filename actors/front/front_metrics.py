"""The front's /metrics: every loaded engine's metrics in one exposition, and its own.

Prometheus' text format wants each metric family once, its samples together: the engines'
texts are merged family by family (their HELP and TYPE lines kept once), and a sample without
a `model_name` label gets its engine's, so no two engines give the same series.
"""
from __future__ import annotations

import re

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")


def labelled(texts: list[tuple[str, str]], own: str) -> str:
    """The engines' texts ((model name, text) pairs) merged, then `own` (the front's)."""
    families: dict[str, tuple[list[str], list[str]]] = {}
    for model, text in texts:
        current = None
        for line in text.splitlines():
            if line.startswith(("# HELP ", "# TYPE ")):
                head, samples = families.setdefault(line.split()[2], ([], []))
                if not any(h.split()[:2] == line.split()[:2] for h in head):
                    head.append(line)
                current = samples
            elif line and not line.startswith("#"):
                sample = with_model(line, model)
                if current is None:           # a sample before any HELP: a family of its own
                    families.setdefault(sample.split("{")[0].split()[0], ([], []))[1].append(
                        sample)
                else:
                    current.append(sample)
    out = [line for head, samples in families.values() for line in (*head, *samples)]
    return "\n".join(out) + "\n" + own


def with_model(line: str, model: str) -> str:
    """A sample line with model_name="<model>" added unless it has one."""
    match = _SAMPLE.match(line)
    if match is None or "model_name=" in (match.group(2) or ""):
        return line
    name, labels, rest = match.groups()
    label = f'model_name="{escape(model)}"'
    inner = labels[1:-1] if labels else ""
    return f"{name}{{{label}{',' if inner else ''}{inner}}}{rest}"


def escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def front_metrics(engines) -> str:
    """The front's own families: each model's state, loads and last load time."""
    states = ("unloaded", "loading", "loaded", "unloading", "failed")
    lines = ["# HELP pagewire:model_state 1 for the state each served model is in",
             "# TYPE pagewire:model_state gauge"]
    for e in engines:
        lines += [f'pagewire:model_state{{model_name="{escape(e.name)}",state="{s}"}} '
                  f'{int(e.state == s)}' for s in states]
    lines += ["# HELP pagewire:model_loads_total times each model was loaded",
              "# TYPE pagewire:model_loads_total counter"]
    lines += [f'pagewire:model_loads_total{{model_name="{escape(e.name)}"}} {e.loads}'
              for e in engines]
    lines += ["# HELP pagewire:model_load_seconds how long each model's last load took",
              "# TYPE pagewire:model_load_seconds gauge"]
    lines += [f'pagewire:model_load_seconds{{model_name="{escape(e.name)}"}} '
              f'{e.load_seconds:.3f}' for e in engines]
    lines += ["# HELP pagewire:model_memory_bytes what each loaded model's engine holds "
              "(proportional set size, measured after its load)",
              "# TYPE pagewire:model_memory_bytes gauge"]
    lines += [f'pagewire:model_memory_bytes{{model_name="{escape(e.name)}"}} '
              f'{e.measured if e.state == "loaded" else 0}' for e in engines]
    return "\n".join(lines) + "\n"
