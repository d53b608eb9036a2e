"""A discriminative reward model: an HF sequence-classification model with one label, whose logit for the rendered
prompt and response is the score (as verl's reward-model worker, and the RMs on the Hugging Face hub, do)."""
from asyncrl.generator.reward_server.items import check_score


def render_conversation(tokenizer, item) -> str:
    """The prompt's messages and the response as the assistant's turn, in the reward model's own chat template (the
    format it was trained on); a tokenizer without one gets the turns' texts joined by newlines."""
    messages = [*item.prompt, {"role": "assistant", "content": item.response}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(message["content"] for message in messages)


class ClassifierScorer:
    def __init__(self, model_path: str, max_length: int, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.truncation_side = "left"  # too long: keep the response's end, which the score depends on
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            model_path, dtype=getattr(torch, dtype)).eval()
        if self.model.config.num_labels != 1:
            raise ValueError(f"reward_server.model_path: {model_path} has {self.model.config.num_labels} labels; a "
                             f"reward model has one (its logit is the score)")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id  # where each padded row's last token is
        self.max_length = max_length

    def score(self, items: list) -> list:
        """One forward pass over the batch; [(score, {}), ...]. Runs in a thread (it holds no event loop)."""
        texts = [render_conversation(self.tokenizer, item) for item in items]
        encoded = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                                 return_tensors="pt", add_special_tokens=False)
        with self.torch.no_grad():
            logits = self.model(**encoded).logits[:, 0].float()
        return [(check_score(value), {}) for value in logits.tolist()]
