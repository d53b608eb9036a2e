"""The data section (`data.*`): where a job's prompts come from and how they are dealt (data/prompts.py reads them on
the learner's rank 0, or on a generator that walks its own copy). Standard library only, like every part's config."""
from dataclasses import dataclass, field
from typing import List, Optional

DATA_SOURCES = ("files", "reasoning_gym")


@dataclass
class DataConfig:
    train_files: List[str] = field(default_factory=list)
    """Parquet files in verl's row format: prompt (chat messages), data_source, reward_model.ground_truth, extra_info."""
    max_prompt_tokens: int = 64
    """Prompts longer than this, in tokens, are skipped and counted."""
    shuffle: bool = True
    """Shuffle prompts each epoch (the learner's dealer, buffer/dealing.py: one order per epoch for the whole fleet)."""
    seed: Optional[int] = None
    """Seed of the epochs' shuffles; None: job.seed."""
    epochs: Optional[int] = None
    """Epochs over the prompts; the job ends after the last one or at learner.total_steps, whichever comes first.
    None: as many as learner.total_steps takes."""
    deal_timeout_s: float = 1800.0
    """A prompt dealt to a generator and not delivered within this long goes back to the epoch (its group, arriving
    later, is refused as unknown_deal); in s. Generators that leave or fall silent give theirs back at once."""
    source: str = "files"
    """Where prompts come from. `files`: data.train_files. `reasoning_gym`: generated procedurally by the
    `reasoning-gym` package for data.reasoning_gym_tasks and scored by its own verifiers (the `reasoning`
    extra); real reasoning tasks that need no download."""
    reasoning_gym_tasks: List[str] = field(default_factory=list)
    """data.source=reasoning_gym: the task names (reasoning_gym.create_dataset's), e.g. [basic_arithmetic]."""
    reasoning_gym_size: int = 1000
    """data.source=reasoning_gym: prompts generated per task (from job.seed, the same on every generator)."""
    val_fraction: float = 0.0
    """Share of the job's prompts held out for evaluation (seeded by job.seed; at least one row when above 0):
    they are never dealt for training, and with eval.every_steps / eval.before_train the fleet evaluates on them
    when eval.files is empty. 0: none held out."""

    max_images: int = 4
    """Multimodal rows (an `images` column, docs/vision.md): the most images one prompt may have; a row with more
    is an error naming it."""
    max_image_bytes: int = 4 << 20
    """Multimodal rows: the most bytes one encoded image may have."""
    max_image_pixels: int = 1 << 22
    """Multimodal rows: the most pixels (width x height, read from the header before anything is decoded) one
    image may have; it is then resized by the model's processor."""

    def __post_init__(self):
        if min(self.max_images, self.max_image_bytes, self.max_image_pixels) < 1:
            raise ValueError("data.max_images, data.max_image_bytes and data.max_image_pixels must be >= 1")
        if self.max_prompt_tokens < 1:
            raise ValueError(f"data.max_prompt_tokens must be >= 1, got {self.max_prompt_tokens}")
        if self.source not in DATA_SOURCES:
            raise ValueError(f"data.source must be one of {DATA_SOURCES}, got {self.source!r}")
        if self.source == "reasoning_gym" and not self.reasoning_gym_tasks:
            raise ValueError("data.source=reasoning_gym needs data.reasoning_gym_tasks, e.g. [basic_arithmetic]")
        if self.epochs is not None and self.epochs < 1:
            raise ValueError(f"data.epochs must be >= 1 (or null: no limit), got {self.epochs}")
        if self.deal_timeout_s <= 0:
            raise ValueError(f"data.deal_timeout_s must be > 0, got {self.deal_timeout_s}")
        if not 0 <= self.val_fraction < 1:
            raise ValueError(f"data.val_fraction must be in [0, 1) (0: nothing held out), got {self.val_fraction}")
        if self.reasoning_gym_size < 1:
            raise ValueError(f"data.reasoning_gym_size must be >= 1, got {self.reasoning_gym_size}")
