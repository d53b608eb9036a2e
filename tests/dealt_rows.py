"""A prompt row as the learner's dealer reads it from the dataset, for tests that deal prompts."""
import dataclasses


@dataclasses.dataclass
class Row:
    prompt_id: str
    prompt_ids: list
    data_source: str = "openai/gsm8k"
    ground_truth: object = "4"
    extra_info: dict = dataclasses.field(default_factory=dict)
    messages: list | None = None
