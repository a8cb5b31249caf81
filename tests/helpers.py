"""Test helpers: tiny random-weight models and the Hugging Face transformers oracle."""
from __future__ import annotations

import os
import shutil

import torch

# Tiny Llama shapes: (hidden, heads, kv_heads, head_dim). Odd on purpose: GQA 1/2/3/4,
# head_dim 64 and 128, hidden != heads * head_dim.
TINY_SHAPES = {
    "gqa2-d64": (128, 4, 2, 64),
    "mha-d64": (128, 2, 2, 64),
    "gqa2-d128": (256, 2, 1, 128),
    "gqa3-odd": (96, 3, 1, 64),
}


def make_tiny_llama(path: str, tokenizer_dir: str, shape: str | tuple = "gqa2-d64", *,
                    vocab_size: int = 512, num_layers: int = 2, tie: bool = False,
                    seed: int = 0, max_position: int = 1024,
                    intermediate_size: int | None = None) -> str:
    """Save a random-weight LlamaForCausalLM (float32) with the borrowed tokenizer. `shape` is
    a TINY_SHAPES name or a (hidden, heads, kv_heads, head_dim) tuple."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, heads, kv_heads, head_dim = TINY_SHAPES[shape] if isinstance(shape, str) else shape
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden,
        intermediate_size=intermediate_size or 2 * hidden + 32,
        num_hidden_layers=num_layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_position, rope_theta=10000.0,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-5)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():   # init_std 0.02 gives near-uniform logits; widen them so greedy is decisive
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(path, safe_serialization=True)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return path


class HFOracle:
    """Greedy decoding with transformers, keeping each step's logits for the tie check."""

    def __init__(self, model):
        self.model = model.eval()

    @classmethod
    def from_dir(cls, path: str) -> "HFOracle":
        from transformers import AutoModelForCausalLM
        return cls(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32))

    @torch.no_grad()
    def greedy(self, prompt: list[int], num_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        ids = torch.tensor([prompt])
        out = self.model(ids, use_cache=True)
        tokens, logits = [], []
        for _ in range(num_tokens):
            step_logits = out.logits[0, -1].float()
            token = int(step_logits.argmax())
            tokens.append(token)
            logits.append(step_logits)
            out = self.model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                             use_cache=True)
        return tokens, logits


# Two correct engines may sum in a different order; where transformers' own top logits are
# this close, either token is a correct greedy choice.
TIE_TOLERANCE = 1e-3


def assert_greedy_equal(ours: list[int], theirs: list[int], logits: list[torch.Tensor],
                        what: str = "") -> None:
    """Equal tokens, except that the sequences may part at a near-tie in the oracle's logits
    (after which nothing more is compared)."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            gap = float(logits[i][b] - logits[i][a])
            assert gap < TIE_TOLERANCE, (
                f"{what} diverged at output {i}: ours {a}, transformers {b} "
                f"(transformers' logit gap {gap:.4g}); ours={ours} theirs={theirs}")
            return
    assert len(ours) == len(theirs), f"{what}: {len(ours)} tokens vs {len(theirs)}"


def lora_case(tokens: int, n: int, k: int, ranks: tuple[int, ...], seed: int = 0,
              dtype: torch.dtype = torch.float32):
    """A step's LoRA inputs for one linear (slot 0): x [T, K] and random adapters of the given
    ranks (weights of `dtype`; B^T in two blocks, the first rank rows at columns [3, 3 + N/3),
    the rest at [N/2, N), as a fused linear's projections) over interleaved rows (every third
    row the base model's). Returns x, adapter_of_row [T], [({0: LoraWeights}, rows)] per
    adapter, and the native table [adapters, 1, ENTRY]."""
    from pagewire.kernels.lora import ENTRY, LoraWeights
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k + 5, generator=g)[:, :k]                  # strided rows
    of_row = torch.tensor([-1 if t % 3 == 2 else t % len(ranks) for t in range(tokens)])
    adapters, table = [], torch.zeros(len(ranks), 1, ENTRY, dtype=torch.int64)
    for i, r in enumerate(ranks):
        a = (torch.randn(r, k, generator=g) * 0.1).to(dtype)
        half = r // 2
        blocks = [(3, torch.randn(half, n // 3, generator=g).to(dtype)),
                  (n // 2, torch.randn(r - half, n - n // 2, generator=g).to(dtype))]
        lw = LoraWeights(a, blocks, 0.5 + i, n)
        adapters.append(({0: lw}, (of_row == i).nonzero().squeeze(1)))
        table[i, 0] = torch.tensor(lw.entry())
    return x, of_row, adapters, table


def rank_blocks(path: str, quantization: str = "none", size: int = 2) -> list[dict[str, str]]:
    """Load `path` as each of `size` tensor-parallel ranks would (no group: loading needs no
    collective) and keep its quantized blocks; per rank {Linear name: "blocks" or "float"},
    after checking that each rank's blocks multiply as its float share of the weights
    does. Also checks every rank holds the single-rank model's values, shared."""
    from pagewire.executor.linear_blocks import keep_quantized
    from pagewire.executor.loader import load_model, read_model
    from pagewire.executor.parallel import Shares, TensorParallel
    from pagewire.kernels import quant
    from pagewire.kernels.ops import select_ops
    from pagewire.kernels.linear import Linear
    from pagewire.model_info import resolve_model

    info, ops = resolve_model(path), select_ops(torch.device("cpu"), "auto")
    whole = load_model(info, "float32", quantization=quantization).state_dict()
    out = []
    for rank in range(size):
        tp = TensorParallel(rank, size)
        model, rounded = read_model(info, "float32", tp, quantization, ops)
        keep_quantized(model, info, 16, rounded=rounded)
        shares, kinds = Shares.of(model.cfg, tp), {}
        for name, w in model.state_dict().items():
            assert torch.equal(w, shares.take(name, whole[name])), name
        for name, linear in model.named_modules():
            if not isinstance(linear, Linear):
                continue
            kinds[name] = "float" if linear.quantized is None else "blocks"
            if linear.quantized is not None:
                x = torch.randn(3, linear.in_features)
                ref = x @ linear.weight.T
                got = quant.matmul(x, linear.quantized)
                assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4), name
        out.append(kinds)
    return out


def use_private_cache(tmp_path, monkeypatch) -> None:
    """Point PAGEWIRE_CACHE_DIR at a fresh directory, so what a test's throwaway models leave
    (converted tokenizers and weights, rounded blocks) stays out of ~/.cache, but keep the
    built kernels' directory (a fresh one would compile each tier's library again) and share
    the session's converted tokenizers: they are keyed by what the conversion reads, and the
    tests' files mostly carry the default model's tokenizer (~5 s a conversion)."""
    from pagewire.kernels import native
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(native.kernel_cache_dir())
    tokenizers = tmp_path.parent / "shared-tokenizers"     # the session's (worker's) base
    tokenizers.mkdir(exist_ok=True)
    (cache / "tokenizers").symlink_to(tokenizers)
    monkeypatch.setenv("PAGEWIRE_CACHE_DIR", str(cache))


def answers_as_planes_and_codes(make_llm, linears, prompts: list[dict], monkeypatch) -> dict:
    """{"planes" / "codes": (the kinds of `linears(model)`' segments, each prompt's greedy
    tokens and cumulative logprob)} from two engines `make_llm()` builds (int8-all on
    avx512_bf16): Q6_K's and Q5_K's superblocks as bit planes, then as their int8 codes. The
    tile cache is off, so each engine packs its own tiles."""
    from pagewire import SamplingParams
    from pagewire.kernels import quant
    monkeypatch.setenv("PAGEWIRE_WEIGHT_CACHE", "0")
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
    answers = {}
    for packing in ("planes", "codes"):
        if packing == "codes":
            for codes in (quant.Q6_KS, quant.Q5_KS):
                monkeypatch.delitem(quant._STORED_SUPERS, codes)
        llm = make_llm()
        kinds = {s.kind for linear in linears(llm.runner.model)
                 for s in linear.quantized.segments}
        answers[packing] = kinds, [(o.outputs[0].token_ids, o.outputs[0].cumulative_logprob)
                                   for o in llm.generate(prompts, params)]
    return answers
