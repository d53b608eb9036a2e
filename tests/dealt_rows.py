"""A prompt row as the learner's dealer reads it from the dataset, for tests that deal prompts."""
from asyncrl.data.prompts import PromptRow


def Row(prompt_id: str, prompt_ids: list, data_source="openai/gsm8k", ground_truth="4", extra_info=None,
        messages=None) -> PromptRow:
    return PromptRow(prompt_id, prompt_ids, data_source, ground_truth, extra_info or {}, messages)
