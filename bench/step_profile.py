"""Where an offline workload's step time goes: each executor step timed in place, then a least
squares fit of the forward time on what the step held.

    python bench/step_profile.py [pagewire bench throughput flags...]
    python bench/step_profile.py --random-input-len 528 --random-output-len 264 \\
        --random-range-ratio 0.94 --num-prompts 256 --kv-cache-memory 4GiB

Runs `pagewire bench throughput` in this process with ModelRunner.execute and _forward
wrapped, then prints the fit: seconds attributed to prefill tokens (linears), prefill tokens x
their context (prefill attention), decode tokens, decode context (decode attention) and a
per-step constant, plus what execute spent outside the forward (LM head, sampling, layout).
The terms are correlated in mixed workloads: read them as a split, not as exact costs.
"""
from __future__ import annotations

import sys
import time

import numpy as np

from pagewire import cli
from pagewire.executor import runner as runner_module

TERMS = ["prefill tokens", "prefill tokens x context / 1e3", "decode tokens",
         "decode context / 1e3", "per step"]


def record_steps() -> list[dict]:
    """Wrap the runner so every step appends {fwd, t, pre, pctx, dec, dctx} to the list."""
    steps: list[dict] = []
    forward, execute = runner_module.ModelRunner._forward, runner_module.ModelRunner.execute

    def timed_forward(self, input_ids, positions, batch, *rest):
        start = time.perf_counter()
        out = forward(self, input_ids, positions, batch, *rest)
        nd = batch.num_decode_tokens
        steps.append(dict(fwd=time.perf_counter() - start, dec=nd,
                          dctx=int(batch.decode_context_lens.sum()) if nd else 0,
                          pre=sum(p.num_tokens for p in batch.prefills),
                          pctx=sum(p.num_tokens * p.context_len for p in batch.prefills)))
        return out

    def timed_execute(self, plan):
        start = time.perf_counter()
        result = execute(self, plan)
        steps[-1]["t"] = time.perf_counter() - start
        return result

    runner_module.ModelRunner._forward = timed_forward
    runner_module.ModelRunner.execute = timed_execute
    return steps


def report(steps: list[dict]) -> None:
    x = np.array([[s["pre"], s["pctx"] / 1e3, s["dec"], s["dctx"] / 1e3, 1] for s in steps])
    y = np.array([s["fwd"] for s in steps])
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    print(f"\n{len(steps)} steps: forward {y.sum():.1f} s, execute "
          f"{sum(s['t'] for s in steps):.1f} s")
    print("| term | ms each | seconds |\n|---|---|---|")
    for name, c, column in zip(TERMS, coef, x.T):
        print(f"| {name} | {c * 1e3:.4f} | {c * column.sum():.1f} |")
    print(f"| outside the forward (LM head, sampling, layout) | | "
          f"{sum(s['t'] - s['fwd'] for s in steps):.1f} |")


if __name__ == "__main__":
    steps = record_steps()
    cli.main(["bench", "throughput", "--dataset-name", "random", *sys.argv[1:]])
    report(steps)
