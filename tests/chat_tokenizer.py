"""A character-level tokenizer with a Qwen-style chat template that shows tools and renders tool messages, built
locally (there is no model hub here) for the episode tests."""
import string

TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\ntools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]


def chat_tokenizer(template: str = TOOL_TEMPLATE):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.train_from_iterator([string.printable], trainers.WordLevelTrainer(special_tokens=SPECIAL))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = template
    return fast
