"""Images in the OpenAI chat API: a tiny random LLaVA served over HTTP through the `openai` client
answers as transformers' LlavaForConditionalGeneration.generate with its processor on the same
images; bad images and image parts the server will not take are one-line 400s that leave the
engine serving; the prefix cache never shares blocks between two images."""

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
        got = client.chat.completions.create(model="tiny", messages=chat_message("what is it", images), max_tokens=6,
                                             temperature=0).choices[0].message.content
        assert got == hf_greedy_chat(model, processor, hf_chat_message("what is it", n), images, 6)
    assert server.wait_idle()


def _solid_png(w: int, h: int) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (w, h), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("served", ["clip"], indirect=True)
def test_bad_images_urls_and_too_many_images_are_one_line_400s_and_the_engine_serves_on(served):
    import httpx

    server, _ = served
    good = png(1)
    bad = {
        "not a readable image": [data_url(b"GIF89a this is no image")],
        "not a readable image (": [data_url(good[:len(good) // 2])],  # truncated
        "over the limit of 100000 pixels": [data_url(_solid_png(400, 300))],
        "over the limit of 20000 bytes": [data_url(png(2, size=120))],
        "does not fetch image URLs from 'example.com'": ["http://example.com/cat.png"],
        "URL scheme 'file' is not accepted": ["file:///etc/passwd"],
        "not valid base64": ["data:image/png;base64,@@@@"],
        "at most 2 (--max-images-per-request)": [data_url(good)] * 3,
    }
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for want, urls in bad.items():
            content = [*[{"type": "image_url", "image_url": {"url": u}} for u in urls], {"type": "text", "text": "hi"}]
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 2})
            assert r.status_code == 400, (want, r.text)
            message = r.json()["error"]["message"]
            assert want in message and "\n" not in message, (want, message)
        # Image tokens typed as text, with no image to fill them: completions and PUT /api refuse them.
        r = client.post("/v1/completions", json={"prompt": "look <image> here", "max_tokens": 2})
        assert r.status_code == 400 and "image tokens that no image fills" in r.json()["error"]["message"], r.text
        r = client.put("/api", json={"prompts": ["look <image> here"], "tokens_to_generate": 2})
        assert r.status_code == 400 and "image tokens that no image fills" in r.text, r.text
        r = client.post("/v1/completions", json={"prompt": [{"type": "image_url", "image_url": {"url": data_url(good)}}]})
        assert r.status_code == 400, r.text
        ok = client.post("/v1/chat/completions", json={"messages": chat_message("fine", [good]), "max_tokens": 3,
                                                            "ignore_eos": True})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3, ok.text
    assert server.wait_idle()


def test_an_image_part_to_a_text_only_model_is_a_one_line_400(tiny_ckpt):
    import httpx

    server = LiveServer(tiny_ckpt)
    try:
        content = [{"type": "image_url", "image_url": {"url": data_url(png(1))}}, {"type": "text", "text": "hi"}]
        with httpx.Client(base_url=server.url, timeout=60) as client:
            r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert "needs a vision-language model" in r.json()["error"]["message"]
            ok = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "max_tokens": 2})
            assert ok.status_code == 200, ok.text
    finally:
        server.stop()


@pytest.mark.parametrize("served", ["clip"], indirect=True)
def test_same_text_with_another_image_shares_no_cached_block_and_the_same_image_does(served):
    server, directory = served
    model, processor = hf_reference(directory)
    check_image_keyed_prefix_cache(server, model, processor,
                                   "the same words every time, long enough to fill blocks after the image", 4)


@pytest.mark.parametrize("served", ["siglip"], indirect=True)
def test_sixteen_concurrent_requests_with_different_images_each_equal_transformers(served):
    server, directory = served
    model, processor = hf_reference(directory)
    images = [png(100 + i) for i in range(16)]
    got = concurrent_image_replies(server.url, "name it", images, 4)
    assert got == [hf_greedy_chat(model, processor, hf_chat_message("name it", 1), [b], 4) for b in images]
    assert server.wait_idle()


def test_preempted_image_requests_recompute_their_features_and_give_the_same_tokens(tmp_path):
    import torch
    from inference_helpers import make_engine, run_all, token_ids

    from tessera.inference.core.image_inputs import ImageInput
    from tessera.inference.core.sampling_params import SamplingParams

    directory = make_llava_dir(tmp_path, "clip")
    n = 16  # image tokens per image: (32 / 8)^2 patches, the class token dropped
    g = torch.Generator().manual_seed(0)
    requests = {f"r{i}": [5 + i, 7] + [0] * n + [9, 11, 13] for i in range(4)}
    engine = make_engine(directory, num_kv_blocks=64, block_size=8, max_num_batched_tokens=64)
    image_id = engine.loaded.config.image_token_id
    jobs = {}
    for rid, prompt in requests.items():
        prompt[2:2 + n] = [image_id] * n
        image = ImageInput.of(torch.randn(3, 32, 32, generator=g), 2, n)
        jobs[rid] = (prompt, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, images=[image]))
    roomy = {rid: token_ids(o) for rid, o in run_all(engine, jobs).items()}
    tight = make_engine(directory, num_kv_blocks=9, block_size=8, max_num_batched_tokens=64, max_model_len=64)
    got = {rid: token_ids(o) for rid, o in run_all(tight, jobs).items()}
    assert tight.scheduler.num_preemptions > 0
    assert got == roomy
    assert not tight.runner.features  # every request's features dropped once its prefill passed them


def test_image_requests_decode_from_the_persistent_batch_and_launch_ahead_once_their_images_are_computed(tmp_path):
    """A vision-language model's decode steps are its language model's: they take their inputs from
    the persistent decode batch, and with --async-scheduling a request with images is launched ahead
    once its image tokens are computed (never a chunk that holds some). Greedy and seeded requests,
    with and without images, give the synchronous engine's tokens."""
    import torch
    from inference_helpers import make_engine, run_all, token_ids

    from tessera.inference.core.image_inputs import ImageInput
    from tessera.inference.core.sampling_params import SamplingParams

    directory = make_llava_dir(tmp_path, "clip")
    n = 16  # image tokens per image
    g = torch.Generator().manual_seed(1)
    jobs = {}
    for i in range(5):
        params = dict(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.8, seed=i)
        if i == 4:  # text only
            jobs["t"] = ([5, 9, 13, 21, 3], SamplingParams(**params))
            continue
        prompt = [5 + i, 7] + [0] * n + [9, 11, 13]
        jobs[f"r{i}"] = (prompt, SamplingParams(**params, images=[ImageInput.of(torch.randn(3, 32, 32, generator=g),
                                                                               2, n)]))
    outs, launched = {}, []
    for overlap in (False, True):
        engine = make_engine(directory, num_kv_blocks=64, block_size=8, max_num_batched_tokens=48, max_num_seqs=8,
                             async_scheduling=overlap)
        image_id = engine.loaded.config.image_token_id
        for prompt, _ in jobs.values():
            prompt[2:2 + n] = [image_id if t == 0 else t for t in prompt[2:2 + n]]
        assert type(engine.runner).keeps_decode_batch()
        launch = engine.runner.launch

        def spy(plan, previous=None, rows=None, launch=launch):
            launched.append([(s.seq.request_id, s.start, s.num_new, j)
                             for s, j in zip(plan.scheduled, rows or [None] * len(plan.scheduled))])
            return launch(plan, previous, rows)
        engine.runner.launch = spy
        outs[overlap] = {rid: token_ids(o) for rid, o in run_all(engine, jobs).items()}
        if not overlap:
            assert engine.runner.decode_batch is not None  # steady decode steps went through it
    assert outs[True] == outs[False]
    rows = [row for plan in launched for row in plan]
    assert any(rid.startswith("r") and j is not None for rid, _, _, j in rows)  # image requests fed ahead
    assert all(start >= 2 + n for rid, start, _, _ in rows if rid.startswith("r"))  # never an image chunk


def test_tessera_serve_refuses_a_tensor_parallel_size_the_vision_language_model_cannot_split_in_one_line(tmp_path,
                                                                                                      capsys):
    """The runner's tensor_parallel_problem, asked on the driver before any worker starts (the
    language model's 2 key/value heads are not replicated over 4 ranks)."""
    from tessera.common.errors import run_cli
    from tessera.inference.entrypoints.serve_cli import main

    directory = make_llava_dir(tmp_path, "clip")
    capsys.readouterr()  # the export's progress lines
    with pytest.raises(SystemExit) as exc:
        run_cli(main, ["--checkpoint", str(directory), "--tensor-parallel", "4", "--no-engine-process"])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert "--tensor-parallel 4: must divide the 2 key/value heads of" in err, err


def test_a_kind_whose_runner_has_no_tensor_parallel_path_is_refused_in_one_line_before_any_worker(tmp_path,
                                                                                                 monkeypatch):
    """The loader asks the serving kind's runner (kinds.py), naming no kind itself: a runner
    without `tensor_parallel_problem` is served on one process only."""
    import torch

    from tessera.common.errors import UserError
    from tessera.inference.worker.loader import load_for_serving
    from tessera.inference.worker.multimodal.runner import VisionLanguageRunner

    directory = make_llava_dir(tmp_path, "clip")
    monkeypatch.delattr(VisionLanguageRunner, "tensor_parallel_problem")
    with pytest.raises(UserError, match=r"^--tensor-parallel 2: model kind 'vision_language' is served on one "
                                        r"process only \(.*\); drop --tensor-parallel$"):
        load_for_serving(directory, torch.device("cpu"), torch.float32, tensor_parallel=2)


def test_a_llava_directory_without_its_processor_file_is_refused_before_any_tensor_parallel_worker_starts(
        tmp_path, monkeypatch):
    """vision_info reads preprocessor_config.json before the runner: under --tensor-parallel the
    runner starts and loads the workers, and nothing after it may fail and leave them running."""
    import torch

    from tessera.common.errors import UserError
    from tessera.inference.config import EngineConfig
    from tessera.inference.engine.llm_engine import LLMEngine
    from tessera.inference.worker.loader import load_for_serving
    from tessera.inference.worker.tensor_parallel import executor

    directory = make_llava_dir(tmp_path, "clip")
    (directory / "preprocessor_config.json").unlink()
    loaded = load_for_serving(directory, torch.device("cpu"), torch.float32, tensor_parallel=2)

    def no_workers(*args, **kwargs):
        raise AssertionError("the tensor-parallel workers were started before the refusal")

    monkeypatch.setattr(executor.TensorParallelExecutor, "__init__", no_workers)
    with pytest.raises(UserError, match="preprocessor_config.json"):
        LLMEngine(loaded, EngineConfig(tensor_parallel=2, kv_cache_tokens=512, max_model_len=64), torch.device("cpu"),
                  torch.float32)
