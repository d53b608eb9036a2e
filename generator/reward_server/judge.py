"""A generative judge: an LLM run by the generators' own engine code (`make_engine`: hf or vLLM), asked a prompt
rendered from `reward_server.template` and scored by `reward_server.score_pattern` on its verdict.

Why the generators' engine: the judge then gets the same batching, the same sampling and the same model families
as the policy, and nothing new to install. A verdict the pattern does not match scores `unparsed_score` and is
counted (`judge_parsed` 0 in its info, `judge/unparsed` in the server's metrics): a judge that rambles must show up
as such, not as a low reward."""
import asyncio
import re

from asyncrl.buffer.group import Sampling
from asyncrl.generator.reward_server.items import check_score


def judge_message(template: str, item) -> str:
    """The judge's question about `item`: the template with {prompt} (the row's last user message), {response},
    {ground_truth} and {data_source} filled in; braces in the texts themselves are kept as they are."""
    prompt = next((m["content"] for m in reversed(item.prompt) if m["role"] == "user"), "")
    fields = {"prompt": prompt, "response": item.response, "ground_truth": "" if item.ground_truth is None
              else str(item.ground_truth), "data_source": item.data_source}
    return re.sub(r"\{(prompt|response|ground_truth|data_source)\}", lambda match: fields[match.group(1)], template)


def parse_verdict(text: str, pattern: str, scale: float, unparsed: float) -> tuple[float, bool]:
    """(score, parsed): the pattern's first match's first group as a number, times `scale`."""
    match = re.search(pattern, text)
    if match is None:
        return unparsed, False
    try:
        return check_score(float(match.group(1)) * scale), True
    except (TypeError, ValueError):
        return unparsed, False


class JudgeScorer:
    def __init__(self, engine, tokenizer, cfg):
        self.engine, self.tokenizer, self.cfg = engine, tokenizer, cfg
        self.unparsed = 0

    def prompt_ids(self, item) -> list:
        messages = [{"role": "user", "content": judge_message(self.cfg.template, item)}]
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        else:
            text = messages[0]["content"]
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        room = self.cfg.max_model_len - self.cfg.max_tokens
        return ids[-room:]  # too long: the template's end (the question) is what the verdict follows

    async def score_batch(self, items: list) -> list:
        """The batch's verdicts, sampled concurrently (the engine decodes them together)."""
        sampling = Sampling(self.cfg.temperature, 1.0, -1, self.cfg.max_tokens)
        outputs = await asyncio.gather(*(self.engine.sample(self.prompt_ids(item), sampling, 1) for item in items))
        results = []
        for (completion,) in outputs:
            verdict = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            score, parsed = parse_verdict(verdict, self.cfg.score_pattern, self.cfg.score_scale,
                                          self.cfg.unparsed_score)
            self.unparsed += not parsed
            results.append((score, {"judge_parsed": float(parsed)}))
        return results
