"""Images through the HTTP API (chat `image_url` parts) on a tiny LLaVA served for real: the
answer is the offline engine's for the same prompt and image (the placeholder where the part
was, widened to the image's rows), the same image hits the prefix cache, and bad images,
URLs and counts are 400s naming `messages` while the server keeps serving."""
from __future__ import annotations

import base64
import io
import os

import httpx
import numpy as np
import pytest

from pagewire import LLM, SamplingParams
from pagewire.testing.server import openai_client, running_server
from pagewire.testing.tiny_vision import make_tiny_llava

pytestmark = pytest.mark.slow
IMAGE_TOKEN = 3                  # <repo_name>: one special token of the borrowed tokenizer


def png(seed: int, size=(40, 36)) -> bytes:
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ask(url: str, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, smol_tokenizer_dir):
    return make_tiny_llava(str(tmp_path_factory.mktemp("llava")), smol_tokenizer_dir,
                           IMAGE_TOKEN, vocab_size=49152)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    root = tmp_path_factory.mktemp("media")
    (root / "one.png").write_bytes(png(1))
    return root


@pytest.fixture(scope="module")
def server(model_dir, media):
    with running_server([model_dir, "--dtype", "float32", "--max-model-len", "256",
                         "--kv-cache-memory", "16MiB", "--limit-mm-per-prompt",
                         '{"image": 2}', "--allowed-local-media-path", str(media)]) as srv:
        yield srv


def chat(server, messages, **fields) -> dict:
    code, body, _ = server.request("POST", "/v1/chat/completions", {
        "messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True,
        "return_tokens_as_token_ids": True, **fields})
    assert code == 200, body
    return body


def token_ids(answer: dict) -> list[int]:
    return [int(e["token"].split(":")[1]) for e in answer["choices"][0]["logprobs"]["content"]]


def test_the_answer_is_the_offline_engines_for_the_same_image(server, model_dir):
    answer = chat(server, ask(data_url(png(1))))
    from transformers import AutoTokenizer
    text = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        [{"role": "user", "content": "<repo_name>What is this?"}], tokenize=False,
        add_generation_prompt=True)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=32)
    offline = llm.generate({"prompt": text, "multi_modal_data": {"image": png(1)}},
                           SamplingParams(temperature=0, max_tokens=6))[0]
    assert offline.prompt_token_ids.count(IMAGE_TOKEN) == 4
    assert answer["usage"]["prompt_tokens"] == len(offline.prompt_token_ids)
    assert token_ids(answer) == offline.outputs[0].token_ids


def test_tokenize_counts_an_images_rows(server):
    answer = chat(server, ask(data_url(png(1))))
    code, body, _ = server.request("POST", "/tokenize", {"messages": ask(data_url(png(1)))})
    assert code == 200 and body["count"] == answer["usage"]["prompt_tokens"]
    assert body["tokens"].count(IMAGE_TOKEN) == 4


def test_a_local_file_is_the_same_image_and_hits_the_prefix_cache(server, media):
    def hits() -> float:
        text = httpx.get(server.url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))
    first = chat(server, ask(data_url(png(1)), "Once more?"))
    before = hits()
    again = chat(server, ask("file://" + os.path.join(media, "one.png"), "Once more?"))
    assert token_ids(again) == token_ids(first)
    assert hits() > before
    text = httpx.get(server.url + "/metrics").text
    encoded = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith(("pagewire:encoder_cache_queries_total",
                                   "pagewire:encoder_seconds_total"))]
    assert len(encoded) == 2 and min(encoded) > 0


def test_an_aborted_image_request_frees_its_blocks(server):
    body = {"messages": ask(data_url(png(2))), "max_tokens": 200, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    assert server.kv_blocks_freed()


@pytest.mark.parametrize("messages, message", [
    (ask(data_url(b"not an image")), "image 0 cannot be read"),
    (ask("data:image/png;base64,@@@"), "not valid base64"),
    (ask("file:///etc/passwd"), "outside the allowed media path"),
    (ask("https://example.com/cat.png"), "not in --allowed-media-domains"),
    (ask("ftp://example.com/cat.png"), "scheme 'ftp' is not supported"),
    (ask(data_url(png(1))) + ask(data_url(png(2))) + ask(data_url(png(3))), "the limit is 2"),
    ([{"role": "user", "content": [{"type": "input_audio"}]}], "'input_audio' is not supported"),
])
def test_bad_images_are_400s_naming_messages(server, messages, message):
    code, body, _ = server.request("POST", "/v1/chat/completions",
                                   {"messages": messages, "max_tokens": 2})
    assert code == 400 and body["error"]["param"] == "messages"
    assert message in body["error"]["message"]
    assert server.healthy()


def test_a_decompression_bomb_is_refused_before_decoding(server):
    from PIL import Image
    buffer = io.BytesIO()
    Image.new("1", (10000, 10000)).save(buffer, format="PNG")          # a few KB, 1e8 pixels
    code, body, _ = server.request("POST", "/v1/chat/completions", {
        "messages": ask(data_url(buffer.getvalue())), "max_tokens": 2})
    assert code == 400 and "over the limit" in body["error"]["message"]
    assert server.healthy()


def test_the_openai_client_sends_images(server):
    reply = openai_client(server).chat.completions.create(
        model=server.request("GET", "/v1/models")[1]["data"][0]["id"], max_tokens=3,
        messages=ask(data_url(png(4))), temperature=0)
    assert reply.usage.prompt_tokens > 4 and reply.choices[0].finish_reason == "length"


def test_every_door_takes_the_image_as_chat_does(server):
    """The same image and question through Responses, Anthropic's Messages and Ollama's chat:
    each the chat route's greedy answer (one request path)."""
    picture = png(5)
    url = data_url(picture)
    want = chat(server, ask(url), max_tokens=5)["choices"][0]["message"]["content"]
    _, responses, _ = server.request("POST", "/v1/responses", {
        "input": [{"role": "user", "content": [
            {"type": "input_image", "image_url": url},
            {"type": "input_text", "text": "What is this?"}]}],
        "max_output_tokens": 5, "temperature": 0})
    model = server.request("GET", "/v1/models")[1]["data"][0]["id"]
    _, anthropic, _ = server.request("POST", "/v1/messages", {
        "model": model, "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(picture).decode()}},
            {"type": "text", "text": "What is this?"}]}]})
    _, ollama, _ = server.request("POST", "/api/chat", {
        "model": model, "stream": False, "options": {"num_predict": 5, "temperature": 0}, "messages": [
            {"role": "user", "content": "What is this?",
             "images": [base64.b64encode(picture).decode()]}]})
    assert responses["output"][0]["content"][0]["text"] == want
    assert anthropic["content"][0]["text"] == want
    assert ollama["message"]["content"] == want
