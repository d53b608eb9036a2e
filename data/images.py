"""The images of a multimodal prompt, read and checked the same way wherever they are used.

verl's multimodal rows carry an `images` column (each entry raw bytes, a datasets `Image` dict `{"bytes": ...,
"path": ...}`, or a path) and `<image>` placeholders in the prompt's text, one per image in order. The learner reads
them when it loads its data, deals them to the generators inside the row, and processes them again for its own
forward: both sides decode and process with the functions here, so both see the same pixels.

Every image is untrusted input. It is bounded before it is decoded: its bytes, its format (an allow-list), and its
pixel count read from the header (a decompression bomb is refused before PIL allocates it). Processing uses the
model's image processor through transformers' PIL backend (`Qwen2VLImageProcessorPil`): the torchvision backend
cannot run without torchvision, which has no CPU build for this torch.
"""
import io
import os

PLACEHOLDER = "<image>"
"""What marks an image's place in a verl row's prompt text."""
QWEN_VISION_SPAN = "<|vision_start|><|image_pad|><|vision_end|>"
"""What a placeholder becomes before the chat template: Qwen2-VL's span around one image-pad token, which the
processor's grid later widens to the image's number of patches."""
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP")


class ImageError(ValueError):
    """An image that is missing, too large, of a refused format, or not an image."""


def image_bytes(entry, base_dir: str = "", max_bytes: int = 4 << 20) -> bytes:
    """The encoded bytes of one `images` entry: bytes, a datasets `Image` dict (its `bytes`, else its `path`), or a
    path (relative to `base_dir`, the parquet file's folder). Read once, at load time, so a dealt row is whole."""
    if isinstance(entry, dict):
        entry = entry.get("bytes") or entry.get("path")
    if isinstance(entry, (bytes, bytearray, memoryview)):
        data = bytes(entry)
    elif isinstance(entry, str) and entry:
        path = entry if os.path.isabs(entry) else os.path.join(base_dir, entry)
        try:
            size = os.path.getsize(path)
            if size > max_bytes:
                raise ImageError(f"image {path} has {size} bytes, more than data.max_image_bytes={max_bytes}")
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError as err:
            raise ImageError(f"image {path} cannot be read: {err}") from None
    else:
        raise ImageError(f"an images entry must be bytes, a path or a {{'bytes', 'path'}} dict, got "
                         f"{type(entry).__name__}")
    if not data:
        raise ImageError("an image has no bytes")
    if len(data) > max_bytes:
        raise ImageError(f"an image has {len(data)} bytes, more than data.max_image_bytes={max_bytes}")
    return data


def decode_image(data: bytes, max_pixels: int = 1 << 22):
    """An RGB PIL image from `data`, checked before it is decoded: an allowed format, and at most `max_pixels`
    pixels by its header."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))  # reads the header only
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise ImageError(f"not an image PIL can read ({err})") from None
    if image.format not in ALLOWED_FORMATS:
        raise ImageError(f"image format {image.format} is not one of {', '.join(ALLOWED_FORMATS)}")
    width, height = image.size
    if width < 1 or height < 1 or width * height > max_pixels:
        raise ImageError(f"an image of {width}x{height} pixels is outside 1..data.max_image_pixels={max_pixels}")
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise ImageError(f"the image cannot be decoded ({err})") from None
    return image.convert("RGB")


def replace_placeholders(messages: list, images: int, span: str = QWEN_VISION_SPAN) -> list:
    """`messages` with each `<image>` in their text replaced by the model's vision span; the count must be
    `images` (a row whose placeholders and images disagree cannot be aligned, so it is refused)."""
    found = sum(message["content"].count(PLACEHOLDER) for message in messages
                if isinstance(message.get("content"), str))
    if found != images:
        raise ImageError(f"the prompt has {found} {PLACEHOLDER} placeholders for {images} images")
    return [{**message, "content": message["content"].replace(PLACEHOLDER, span)}
            if isinstance(message.get("content"), str) else message for message in messages]


def pads_per_image(grid_thw, merge_size: int) -> list[int]:
    """How many image-pad tokens each image takes in the model's input: its grid's t·h·w over merge_size²."""
    return [int(t) * int(h) * int(w) // (merge_size * merge_size) for t, h, w in grid_thw]


def expand_image_pads(ids: list, pad_id: int, counts: list[int]) -> list:
    """`ids` (one pad token per image, as rows travel and vLLM takes them) with the i-th pad repeated counts[i]
    times, the form the model's forward takes."""
    out, index = [], 0
    for token in ids:
        if token == pad_id:
            if index >= len(counts):
                raise ImageError(f"the prompt has more image pads than its {len(counts)} images")
            out.extend([token] * counts[index])
            index += 1
        else:
            out.append(token)
    if index != len(counts):
        raise ImageError(f"the prompt has {index} image pads for {len(counts)} images")
    return out
