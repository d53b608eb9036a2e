"""Vision demo task: name the colour of the square drawn in an image (`<image>colour?` -> `r`). The image is 56x56
white with one square of random size and place in red, green, blue or yellow; the answer is the colour's letter.
Small enough that a tiny Qwen2.5-VL built from its config (learner/init_model.py::build_vision_model) learns it on
2 CPU cores by RL alone, from a random start (no SFT: the warm start takes text only).

Rows follow verl's multimodal format: `prompt` with one `<image>` placeholder, `images` ([{"bytes": PNG}]),
`data_source`, `reward_model.ground_truth`, `extra_info`.
"""
import io
import random

from asyncrl.generator.tasks.exact_match import compute_score  # noqa: F401 (the task's reward)

DATA_SOURCE = "asyncrl/square_colour"
COLOURS = {"r": (220, 30, 30), "g": (30, 170, 30), "b": (30, 60, 220), "y": (230, 200, 20)}
SIZE = 56
VISION = True
"""The task's prompts carry images: launch/demo.py builds a vision-language model for it, and no SFT warm start."""
TOKENIZER_MODEL = "byte_level"
EOS = "<|im_end|>"
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
SPECIAL_TOKENS = ["<pad>", "<unk>", EOS, *VISION_TOKENS]
ADDED_TOKENS: list = []
MAX_POSITIONS = 128
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}{% endfor %}"
"""The contents, concatenated: the prompt is the image's span and `colour?`, and the model answers right after."""


def draw(colour: str, rng: random.Random) -> bytes:
    """A PNG of a white square canvas with one filled square of `colour` at a random size and place."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    side = rng.randint(14, 40)
    left, top = rng.randint(0, SIZE - side), rng.randint(0, SIZE - side)
    ImageDraw.Draw(image).rectangle([left, top, left + side - 1, top + side - 1], fill=COLOURS[colour])
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_rows(num_prompts: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for index in range(num_prompts):
        colour = rng.choice(sorted(COLOURS))
        rows.append({
            "prompt": [{"role": "user", "content": "<image>colour?"}],
            "images": [{"bytes": draw(colour, rng), "path": None}],
            "data_source": DATA_SOURCE,
            "reward_model": {"style": "rule", "ground_truth": colour},
            "extra_info": {"index": index, "split": "train"},
        })
    return rows


def sft_rows(num_rows: int, seed: int) -> list[dict]:
    """No SFT rows: the warm start takes text only (launch/demo.py skips it for a vision task)."""
    return []


def tokenizer_corpus(seed: int) -> list[str]:
    """Every character the task writes: the prompt's text and the four answers."""
    return ["colour?" + "".join(sorted(COLOURS))]
