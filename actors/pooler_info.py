"""What a pooling model's output is, read without torch: its task, how a sequence's hidden
states pool to one vector, and what a request's options may do with it (ModelInfo.pooler;
None for a model that generates). Resolved once, at start, from the model's config.json,
sentence-transformers' files beside it (modules.json, the pooling module's config, Dense
projection modules' configs, a Normalize module) and the flags --runner, --convert and
--pooler-config."""
from __future__ import annotations

import json
import os

import msgspec

POOLING_TASKS = EMBED, CLASSIFY, TOKEN_CLASSIFY = ("embed", "classify", "token_classify")
POOLING_TYPES = CLS, MEAN, LAST = ("CLS", "MEAN", "LAST")
ALL = "ALL"                  # token_classify's: every token is an output (vLLM's name)
ACTIVATIONS = SIGMOID, SOFTMAX, NO_ACTIVATION = ("sigmoid", "softmax", "none")
# a Dense module's activation_function (a torch.nn module's class name) -> what applies it
DENSE_ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu",
                     "Sigmoid": "sigmoid"}


class DenseModule(msgspec.Struct, kw_only=True, frozen=True):
    """One sentence-transformers Dense module: activation(x @ weight.T + bias) over a pooled
    vector, in_features -> out_features. Its weights stay in `folder` (under the model's
    directory) until the process that pools reads them (executor/dense_projection.py)."""
    folder: str
    in_features: int
    out_features: int
    bias: bool = True
    activation: str = "tanh"                 # DENSE_ACTIVATIONS' values


class PoolerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """A pooling model's output. `task` embed: the pooled hidden state (`size` values, the
    hidden size, or the last `dense` module's out_features: sentence-transformers' Dense
    projections, applied by the executor after pooling), normalised by default where `normalize`
    (sentence-transformers' Normalize module, or the runner's default), truncatable to
    `matryoshka_dimensions` (None: any `dimensions` request is refused); classify: a
    classifier's logits, one per label (`labels`, id2label's order), through `activation` by
    default (sigmoid for one label, softmax for several); token_classify (a
    *ForTokenClassification encoder: named entities, part-of-speech tags): every token's
    classifier logits, [tokens, labels], each row through `activation`, pooling type ALL; a
    causal LM classifies with its LM
    head's rows of `classifier_tokens` (--pooler-config classifier_from_token: a reranker read
    from a yes/no token, Qwen3-Reranker's way: two tokens [false, true] give one score, true's
    logit minus false's). `encoder_only`: attention is bidirectional, so there is no KV cache
    and a prompt runs whole in one step (executor/pooling_runner.py); else a causal model's
    prompt runs as a prefill that samples nothing (prefix cache and chunks as usual).
    `also_generates`: a causal LM under --runner generate with a --convert serves pooling and
    generation requests both (one engine, one batch); else a pooling model answers pooling
    requests only."""
    task: str                                # POOLING_TASKS
    pooling_type: str                        # POOLING_TYPES, or ALL (token_classify)
    size: int
    normalize: bool = False
    matryoshka_dimensions: list[int] | None = None
    labels: list[str] = []
    activation: str = NO_ACTIVATION          # ACTIVATIONS
    encoder_only: bool = False
    also_generates: bool = False
    classifier_tokens: list[int] = []
    dense: list[DenseModule] = []            # applied in order after pooling, before normalising


RUNNERS = AUTO, GENERATE, POOLING = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", EMBED, CLASSIFY)
_ST_MODES = {"pooling_mode_cls_token": CLS, "pooling_mode_mean_tokens": MEAN,
             "pooling_mode_lasttoken": LAST}
_OVERRIDES = ("pooling_type", "normalize", "use_activation",     # --pooler-config's keys
              "classifier_from_token")


def resolve_pooler(path: str, cfg: dict, architecture: str, encoder_only: bool,
                   runner: str = AUTO, convert: str = "auto",
                   overrides: dict | None = None, token_id=None) -> PoolerInfo | None:
    """The model's pooler under --runner / --convert / --pooler-config (None: it generates).
    An encoder-only architecture only pools; a causal LM pools under --runner pooling or a
    --convert (embed: its last token's final hidden state; classify: its LM head's logits of
    classifier_from_token's tokens). `token_id(text)`: the one token a text encodes to."""
    if runner not in RUNNERS or convert not in CONVERTS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)} and --convert one of "
                         f"{', '.join(CONVERTS)}; got {runner!r}, {convert!r}")
    classifies = architecture.endswith("ForSequenceClassification")
    pools = encoder_only or classifies or runner == POOLING or convert in (EMBED, CLASSIFY)
    if runner == GENERATE and (encoder_only or classifies):
        raise ValueError(f"{architecture} cannot generate: it is an encoder-only model or a "
                         "classifier (serve it with --runner pooling)")
    if not pools:
        return None
    if architecture.endswith("ForTokenClassification"):
        return _token_tagger(cfg, architecture, convert, overrides or {})
    task = convert if convert in (EMBED, CLASSIFY) else (CLASSIFY if classifies else EMBED)
    overrides = dict(overrides or {})
    from_tokens = overrides.pop("classifier_from_token", None)
    if task == CLASSIFY and not classifies and not (from_tokens and not encoder_only):
        raise ValueError(f"--convert classify needs a classifier's weights "
                         f"(*ForSequenceClassification) or, for a causal LM, --pooler-config "
                         f"classifier_from_token; {architecture} has neither")
    if from_tokens:
        return _token_classifier(from_tokens, token_id, runner == GENERATE)
    unknown = sorted(set(overrides) - set(_OVERRIDES))
    if unknown:
        raise ValueError(f"--pooler-config: unknown keys {unknown} (known: {list(_OVERRIDES)})")
    pooler = _classifier(cfg, encoder_only, overrides) if task == CLASSIFY else \
        _embedder(path, cfg, encoder_only, overrides)
    return msgspec.structs.replace(pooler, also_generates=runner == GENERATE)


def _embedder(path: str, cfg: dict, encoder_only: bool, overrides: dict) -> PoolerInfo:
    """sentence-transformers' modules where present: the pooling module's mode, Dense
    projections, a Normalize module; else CLS for an encoder, LAST for a causal LM,
    normalised (vLLM's defaults)."""
    modules = _sentence_modules(path)
    # CLIP's text tower reads its end-of-text token, the last
    first = CLS if encoder_only and "projection_dim" not in cfg else LAST
    pooling = _st_pooling_mode(path, modules) or first
    normalize = True if not modules else any(m.endswith("Normalize") for m in modules.values())
    pooling = str(overrides.get("pooling_type", pooling)).upper()
    if pooling not in POOLING_TYPES:
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {pooling!r}")
    if not encoder_only and pooling != LAST:
        raise ValueError(f"a causal model pools its last token (pooling_type LAST); "
                         f"{pooling} is not supported yet")
    size = int(cfg.get("hidden_size", cfg.get("text_config", {}).get("hidden_size", 0)))
    dense = _dense_modules(path, modules, size)
    size = dense[-1].out_features if dense else size
    dims = cfg.get("matryoshka_dimensions")
    if dims is None and cfg.get("is_matryoshka"):
        dims = list(range(1, size + 1))
    return PoolerInfo(task=EMBED, pooling_type=pooling, size=size,
                      normalize=bool(overrides.get("normalize", normalize)),
                      matryoshka_dimensions=[int(d) for d in dims] if dims else None,
                      encoder_only=encoder_only, dense=dense)


def _classifier(cfg: dict, encoder_only: bool, overrides: dict) -> PoolerInfo:
    """id2label in id order; sigmoid for one label, softmax for several, or what
    sentence-transformers' CrossEncoder config names (an Identity: none)."""
    id2label = cfg.get("id2label") or {}
    count = int(cfg.get("num_labels", len(id2label) or 2))
    labels = [str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(count)]
    activation = SIGMOID if count == 1 else SOFTMAX
    named = (cfg.get("sentence_transformers") or {}).get("activation_fn", "")
    if named.endswith("Identity"):
        activation = NO_ACTIVATION
    elif named.endswith("Sigmoid"):
        activation = SIGMOID
    if overrides.get("use_activation") is False:
        activation = NO_ACTIVATION
    return PoolerInfo(task=CLASSIFY, pooling_type=CLS if encoder_only else LAST, size=count,
                      labels=labels, activation=activation, encoder_only=encoder_only)


def _token_tagger(cfg: dict, architecture: str, convert: str, overrides: dict) -> PoolerInfo:
    """A *ForTokenClassification encoder's pooler: every token's logits (token_classify),
    through softmax (sigmoid for one label) unless --pooler-config use_activation is false."""
    if convert not in ("auto", "none"):
        raise ValueError(f"{architecture} classifies every token (task token_classify); "
                         f"--convert {convert} does not apply to it")
    unknown = sorted(set(overrides) - {"use_activation"})
    if unknown:
        raise ValueError(f"--pooler-config: {unknown} do not apply to {architecture} (it "
                         "takes use_activation)")
    classifier = _classifier(cfg, True, overrides)
    return msgspec.structs.replace(classifier, task=TOKEN_CLASSIFY, pooling_type=ALL)


def _token_classifier(texts: list[str], token_id, also_generates: bool) -> PoolerInfo:
    """A causal LM's classifier from its LM head's rows of these tokens."""
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        raise ValueError("classifier_from_token must be a list of token texts, e.g. "
                         "[\"no\", \"yes\"]")
    ids = [token_id(t) for t in texts]
    labels = texts[1:] if len(texts) == 2 else texts
    return PoolerInfo(task=CLASSIFY, pooling_type=LAST, size=len(labels), labels=labels,
                      activation=SIGMOID if len(labels) == 1 else SOFTMAX,
                      classifier_tokens=ids, also_generates=also_generates)


def _sentence_modules(path: str) -> dict[str, str]:
    """modules.json's {folder: type} (sentence-transformers' pipeline, in its order), {}
    where absent."""
    file = os.path.join(path, "modules.json")
    if not os.path.isfile(file):
        return {}
    with open(file) as f:
        return {m.get("path", ""): m.get("type", "") for m in json.load(f)}


def _dense_modules(path: str, modules: dict[str, str], width: int) -> list[DenseModule]:
    """The Dense modules in modules.json's order, each reading the one before's output (the
    first, the pooled hidden state of `width`); refused by file where this cannot apply them."""
    dense, normalized = [], False
    for folder, kind in modules.items():
        normalized = normalized or kind.endswith("Normalize")
        if not kind.endswith("Dense"):
            continue
        file = os.path.join(path, folder, "config.json")
        if normalized:       # the engine's vector leaves it raw: normalising is the request's
            raise ValueError(f"{os.path.join(path, 'modules.json')}: a Dense module ({folder}) "
                             "after Normalize is not supported")
        if not os.path.isfile(file):
            raise ValueError(f"{file}: the Dense module's config is missing")
        with open(file) as f:
            st = json.load(f)
        name = st.get("activation_function", "torch.nn.modules.activation.Tanh")
        short = name.rsplit(".", 1)[-1] if str(name).startswith("torch.") else ""
        if short not in DENSE_ACTIVATIONS:
            raise ValueError(f"{file}: activation_function {name!r} is not supported (one of "
                             f"torch.nn's {', '.join(DENSE_ACTIVATIONS)})")
        reads = {st.get("module_input_name"), st.get("module_output_name")} - {None}
        if st.get("use_residual") or reads - {"sentence_embedding"}:
            raise ValueError(f"{file}: a Dense module with a residual or over other features "
                             "than the sentence embedding is not supported")
        module = DenseModule(folder=folder, in_features=int(st["in_features"]),
                             out_features=int(st["out_features"]), bias=bool(st.get("bias", True)),
                             activation=DENSE_ACTIVATIONS[short])
        if module.in_features != width:
            raise ValueError(f"{file}: in_features {module.in_features} but the vector "
                             f"before it has {width} values")
        dense.append(module)
        width = module.out_features
    return dense


def _st_pooling_mode(path: str, modules: dict[str, str]) -> str | None:
    """The sentence-transformers pooling module's mode, or None."""
    folder = next((p for p, t in modules.items() if t.endswith("Pooling")), None)
    file = os.path.join(path, folder or "1_Pooling", "config.json")
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        st = json.load(f)
    modes = [mode for key, mode in _ST_MODES.items() if st.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{file}: pooling modes {modes or 'none'} (one of "
                         f"{', '.join(_ST_MODES)} is supported)")
    return modes[0]
