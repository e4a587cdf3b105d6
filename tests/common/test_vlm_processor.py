"""The shared image processor against transformers' CLIPImageProcessor and SiglipImageProcessor on
the same PIL images, and its refusals of bad image bytes."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image

from tessera.common.errors import UserError
from tessera.common.models.vision_language.processor import ImageProcessor, decode_image

transformers = pytest.importorskip("transformers")


def _image(w: int, h: int, mode: str = "RGB", fmt: str = "PNG") -> bytes:
    g = torch.Generator().manual_seed(w * 1000 + h)
    arr = torch.randint(0, 256, (h, w, 4 if mode == "RGBA" else 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(arr, "RGBA" if mode == "RGBA" else "RGB").convert(mode).save(buf, fmt)
    return buf.getvalue()


@pytest.mark.parametrize("cls,kwargs", [
    ("CLIPImageProcessor", dict(size={"shortest_edge": 40}, crop_size={"height": 36, "width": 36})),
    ("SiglipImageProcessor", dict(size={"height": 32, "width": 32})),
])
def test_pixel_values_equal_transformers_image_processor_on_the_same_image(tmp_path, cls, kwargs):
    theirs = getattr(transformers, cls)(**kwargs)
    theirs.save_pretrained(tmp_path)
    ours = ImageProcessor.from_dir(tmp_path)
    for w, h, mode, fmt in ((61, 45, "RGB", "PNG"), (30, 77, "RGBA", "PNG"), (50, 50, "L", "JPEG"), (20, 18, "P", "PNG")):
        image = decode_image(_image(w, h, mode, fmt), "test image")
        want = theirs(images=image, return_tensors="pt")["pixel_values"][0]
        got = ours(image)
        assert got.shape == want.shape and got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_bad_image_bytes_are_refused_in_one_line_naming_the_image():
    good = _image(40, 40)
    for data, message in ((b"not an image", "not a readable image"), (good[: len(good) // 2], "not a readable image"),
                          (_image(300, 300), "over the limit")):
        with pytest.raises(UserError, match=message) as e:
            decode_image(data, "record 7 image 0", max_pixels=200 * 200)
        assert str(e.value).startswith("record 7 image 0:") and "\n" not in str(e.value)


def test_an_image_processor_setting_not_applied_is_refused_naming_it():
    with pytest.raises(UserError, match="image_processor_type"):
        ImageProcessor.from_hf({"image_processor_type": "LlavaNextImageProcessor"}, "preprocessor_config.json")
    with pytest.raises(UserError, match="do_pad"):
        ImageProcessor.from_hf({"image_processor_type": "CLIPImageProcessor", "do_pad": True}, "p.json")
