"""Images under `--tensor-parallel 2`: a tiny random LLaVA (CLIP + Llama, 16x16 images of 8x8
patches) served by two gloo workers, each holding its shard of the tower, the projector and the
language model, answers through the `openai` client as transformers' generate with its processor,
for 1 and 2 images, concurrent requests with different images under chunked prefill and
preemption; the prefix cache keys blocks by image there too; a bad image is a one-line 400 and
the workers serve on. One server (one pair of workers) for the whole file."""

from __future__ import annotations

import pytest
from live_server import LiveServer
from vlm_serving_helpers import (
    LIMITS,
    chat_message,
    check_image_keyed_prefix_cache,
    concurrent_image_replies,
    data_url,
    hf_chat_message,
    hf_greedy_chat,
    hf_reference,
    make_llava_dir,
    png,
)

pytest.importorskip("transformers")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    directory = make_llava_dir(tmp_path_factory.mktemp("vlm-tp"), "clip", size=16, text_hidden=32,
                               weight_std=0.5)
    # 16-token prefill chunks split the prompts (and their images' tokens) over steps; 12 blocks of
    # 8 hold two of the concurrent requests at once, so the rest wait or are preempted.
    server = LiveServer(directory, limits=LIMITS, tensor_parallel=2, max_num_batched_tokens=16, num_kv_blocks=12,
                        block_size=8, max_num_seqs=8, max_model_len=64)
    model, processor = hf_reference(directory)
    yield server, model, processor
    server.stop()
    server.engine.close()


def test_tp2_greedy_chat_with_one_and_two_images_equals_transformers_generate(served):
    server, model, processor = served
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    for n in (1, 2):
        images = [png(10 * n + i) for i in range(n)]
        got = client.chat.completions.create(model="tiny", messages=chat_message("what is it", images), max_tokens=6,
                                             temperature=0).choices[0].message.content
        assert got == hf_greedy_chat(model, processor, hf_chat_message("what is it", n), images, 6), n
    assert server.wait_idle()


def test_tp2_concurrent_requests_with_different_images_each_equal_transformers_through_preemption(served):
    server, model, processor = served
    images = [png(100 + i) for i in range(4)]
    before = server.engine.scheduler.num_preemptions
    got = concurrent_image_replies(server.url, "name this one", images, 10)
    assert got == [hf_greedy_chat(model, processor, hf_chat_message("name this one", 1), [b], 10) for b in images]
    assert len(set(got)) > 2  # the images, not the text, decide the replies
    assert server.engine.scheduler.num_preemptions > before  # some features and K/V were computed again
    assert server.wait_idle()


def test_tp2_same_text_with_another_image_shares_no_cached_block_and_the_same_image_does(served):
    server, model, processor = served
    first, other = check_image_keyed_prefix_cache(server, model, processor,
                                                  "the same words every time after the image", 8)
    assert other != first


def test_tp2_a_bad_image_is_a_one_line_400_and_the_workers_serve_on(served):
    import httpx

    server, _, _ = served
    good = png(1)
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for want, url in (("not a readable image (", data_url(good[:len(good) // 2])),
                          ("over the limit of 20000 bytes", data_url(png(2, size=120)))):
            content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 2})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert want in message and "\n" not in message, message
        ok = client.post("/v1/chat/completions", json={"messages": chat_message("fine", [good]), "max_tokens": 3,
                                                            "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
    assert server.engine.runner.executor.alive()


def test_tp2_serves_a_tessera_checkpoint_of_a_llava_as_one_process_does(tmp_path):
    """Each worker reads its slices of the tower, projector and language model from the layout-free
    DCP checkpoint (a Tessera checkpoint keeps its vocabulary rows: 300 here, which 2 divides)."""
    import torch
    from inference_helpers import make_engine, run_all, token_ids

    from tessera.ckpt_convert.cli import run
    from tessera.inference.core.image_inputs import ImageInput
    from tessera.inference.core.sampling_params import SamplingParams

    directory = make_llava_dir(tmp_path, "clip", size=16, text_hidden=32, weight_std=0.5, vocab=299)
    assert run(["import", "--format", "hf", "--input", str(directory), "--output", str(tmp_path / "ck"),
                "--quiet"]) == 0
    one = make_engine(directory, num_kv_blocks=32, block_size=8, max_num_batched_tokens=8, max_num_seqs=4)
    image_id, n = one.loaded.config.image_token_id, one.loaded.config.image_seq_len
    g = torch.Generator().manual_seed(0)
    jobs = {}
    for i, k in enumerate((1, 2, 1)):  # 8-token chunks: every image's tokens span two steps
        prompt = [5 + i, 7, 8] + [image_id] * (n * k) + [9, 11]
        images = [ImageInput.of(torch.randn(3, 16, 16, generator=g), 3 + j * n, n) for j in range(k)]
        jobs[f"r{i}"] = (prompt, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, images=images))
    want = {rid: token_ids(o) for rid, o in run_all(one, jobs).items()}
    tp = make_engine(tmp_path / "ck", num_kv_blocks=32, block_size=8, max_num_batched_tokens=8, max_num_seqs=4,
                     tensor_parallel=2)
    try:
        got = {rid: token_ids(o) for rid, o in run_all(tp, jobs).items()}
    finally:
        tp.close()
    assert got == want
    assert len({tuple(t) for t in want.values()}) > 1  # the images decide the tokens
