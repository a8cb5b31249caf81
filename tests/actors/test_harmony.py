"""--reasoning-parser openai_gptoss through the actors: gpt-oss's markers are special tokens
of its vocabulary (here added to the default model's tokenizer), so the gateway has a chat
request detokenized with them kept, the detokenizer's streamed text carries them to the
chat output, which splits off the analysis channel as reasoning; a constraint starts at the
final channel's <|message|> token."""
from __future__ import annotations

import pytest

from pagewire.config import EngineConfig
from pagewire.detokenizer import Detokenizer
from pagewire.gateway import harmony
from pagewire.gateway.chat_output import ChatOutput
from pagewire.gateway.tools import ToolPlan
from pagewire.tokenizer import RequestTokenizer
from pagewire.wire import SamplingParams
from pagewire.wire.ids import SeqId
from pagewire.wire.to_detokenizer import DetokStart, TokenDelta, TokenDeltas

MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|constrain|>"]
OUTPUT = ("<|channel|>analysis<|message|>The user asks 2 + 2: it is 4.<|end|><|start|>assistant"
          "<|channel|>final<|message|>It is 4.<|return|>")


@pytest.fixture(scope="module")
def config():
    return EngineConfig.from_options(max_model_len=64, reasoning_parser="openai_gptoss").resolve()


@pytest.fixture(scope="module")
def tokenizer(config):
    from pagewire.hf_tokenizer import load_tokenizer
    tok = load_tokenizer(config.model.model_info)
    tok.add_special_tokens({"additional_special_tokens": MARKERS})
    return tok


def test_a_constraint_starts_at_the_final_channels_message(config, tokenizer):
    rt = RequestTokenizer(config, tokenizer)
    channel, message = tokenizer.convert_tokens_to_ids(["<|channel|>", "<|message|>"])
    end = rt.reasoning_end
    assert (end[0], end[-1]) == (channel, message)
    assert tokenizer.decode(end[1:-1]) == "final"
    prompt = tokenizer.encode("<|start|>user<|message|>hi<|end|><|start|>assistant")
    assert rt.start_after(prompt) == end
    assert rt.start_after(prompt + end) is None        # the prompt opened the final channel


def test_chat_requests_keep_the_markers_only_for_this_parser():
    s = SamplingParams(max_tokens=4)
    assert harmony.keep_markers(s, "openai_gptoss").skip_special_tokens is False
    assert harmony.keep_markers(s, "qwen3") is s and harmony.keep_markers(s, None) is s


@pytest.mark.parametrize("per_delta", [1, 2, 5])
def test_the_detokenized_stream_splits_into_reasoning_and_content(tokenizer, per_delta):
    """Token ids (the model's, the last its <|return|>) through the detokenizer with the
    request's sampling as the gateway sends it, then the chat output, streamed and whole."""
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    assert ids[-1] == tokenizer.convert_tokens_to_ids("<|return|>")
    sampling = harmony.keep_markers(SamplingParams(max_tokens=64), "openai_gptoss")
    detok = Detokenizer(tokenizer)
    prompt = tokenizer.encode("<|start|>assistant", add_special_tokens=False)
    detok.start(DetokStart(req_id="a", prompt_tail=prompt, num_prompt_tokens=len(prompt),
                           skip_special_tokens=sampling.skip_special_tokens))
    out, text, deltas = ChatOutput(ToolPlan(), "openai_gptoss"), "", []
    for i in range(0, len(ids), per_delta):
        last = i + per_delta >= len(ids)
        texts, _ = detok.on_deltas(TokenDeltas([TokenDelta(SeqId("a"), ids[i:i + per_delta],
                                                           "stop" if last else None)]))
        for t in texts:
            text += t.text
            deltas += out.feed(t.text)
    deltas += out.finish("stop")[0]
    expected = {"reasoning_content": "The user asks 2 + 2: it is 4.", "content": "It is 4."}
    assert {k: "".join(d.get(k, "") for d in deltas) for k in expected} == expected
    whole, _ = ChatOutput(ToolPlan(), "openai_gptoss").message(text, "stop")
    assert {k: whole[k] for k in expected} == expected
