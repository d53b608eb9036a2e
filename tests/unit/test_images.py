"""Images of multimodal prompts (data/images.py): every entry form verl rows use, the bounds checked before
decoding (bytes, format, pixels by the header), placeholders against images, and pad expansion."""
import io

import pytest

from asyncrl.data.images import (ImageError, decode_image, expand_image_pads, image_bytes, pads_per_image,
                                 replace_placeholders)


def encoded(size=(6, 4), fmt="PNG", mode="RGB") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new(mode, size, color=0).save(buffer, format=fmt)
    return buffer.getvalue()


def test_every_entry_form_gives_the_same_bytes(tmp_path):
    data = encoded()
    (tmp_path / "a.png").write_bytes(data)
    for entry in (data, bytearray(data), {"bytes": data, "path": None}, {"bytes": None, "path": "a.png"}, "a.png",
                  str(tmp_path / "a.png")):
        assert image_bytes(entry, base_dir=str(tmp_path)) == data
    with pytest.raises(ImageError, match="cannot be read"):
        image_bytes("missing.png", base_dir=str(tmp_path))
    with pytest.raises(ImageError, match="must be bytes, a path"):
        image_bytes(3)
    with pytest.raises(ImageError, match="no bytes"):
        image_bytes(b"")
    with pytest.raises(ImageError, match="more than data.max_image_bytes=10"):
        image_bytes(data, max_bytes=10)
    with pytest.raises(ImageError, match="more than data.max_image_bytes=10"):
        image_bytes("a.png", base_dir=str(tmp_path), max_bytes=10)


def test_decoding_is_bounded_before_the_pixels_are_allocated():
    image = decode_image(encoded(fmt="JPEG", mode="L"))
    assert image.mode == "RGB" and image.size == (6, 4)
    bomb = encoded(size=(4000, 4000), mode="1")  # a few KiB on the wire, 16M pixels once decoded
    assert len(bomb) < 10_000
    with pytest.raises(ImageError, match="4000x4000 pixels is outside"):
        decode_image(bomb, max_pixels=1 << 20)
    with pytest.raises(ImageError, match="format GIF is not one of"):
        decode_image(encoded(fmt="GIF", mode="L"))
    with pytest.raises(ImageError, match="not an image"):
        decode_image(b"\x89PNG not really")
    from PIL import Image

    buffer = io.BytesIO()
    Image.frombytes("L", (64, 64), bytes(range(256)) * 16).save(buffer, format="PNG")
    whole = buffer.getvalue()
    with pytest.raises(ImageError, match="cannot be decoded"):
        decode_image(whole[:len(whole) * 3 // 4])  # a truncated file: the header reads, the pixels do not


def test_placeholders_must_match_the_images_and_become_the_vision_span():
    messages = [{"role": "system", "content": "count"}, {"role": "user", "content": "<image> and <image>: how many?"}]
    out = replace_placeholders(messages, 2, span="[V]")
    assert out[1]["content"] == "[V] and [V]: how many?" and messages[1]["content"].startswith("<image>")
    with pytest.raises(ImageError, match="2 <image> placeholders for 1 images"):
        replace_placeholders(messages, 1)


def test_each_images_pad_widens_to_its_grid():
    counts = pads_per_image([(1, 4, 4), (1, 2, 6)], merge_size=2)
    assert counts == [4, 3]
    assert expand_image_pads([1, 9, 2, 9, 3], 9, counts) == [1, 9, 9, 9, 9, 2, 9, 9, 9, 3]
    with pytest.raises(ImageError, match="1 image pads for 2 images"):
        expand_image_pads([1, 9, 2], 9, counts)
    with pytest.raises(ImageError, match="more image pads than its 2 images"):
        expand_image_pads([9, 9, 9], 9, counts)
