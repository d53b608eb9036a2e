"""An engine that answers with scripted turns, and the Hermes tool-call text a scripted turn carries, for the
multi-turn episode tests."""
import json

from asyncrl.generator.engines.base import Completion


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


class ScriptedEngine:
    """Answers each request with the next scripted turn (text, finish reason), encoded; records every request."""

    resumed_requests = 0

    def __init__(self, tokenizer, turns, version=7):
        self.tokenizer, self.turns, self.version = tokenizer, list(turns), version
        self.requests = []
        self.sampled = []

    async def sample(self, prompt_ids, sampling, n):
        assert n == 1
        self.requests.append(list(prompt_ids))
        text, finish = self.turns.pop(0) if self.turns else ("done", "stop")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if finish == "stop":
            ids.append(self.tokenizer.eos_token_id)
        self.sampled.append(ids)
        return [Completion(token_ids=ids, logprobs=[-0.25] * len(ids), versions=[self.version] * len(ids),
                           finish_reason=finish)]


class StreamingScriptedEngine(ScriptedEngine):
    """The scripted engine as a base.StreamingEngine: each turn's completion grows one token at a time."""

    async def start(self):
        pass

    async def load_weights(self, staged, fallback=None):
        pass

    async def close(self):
        pass

    async def sample_stream(self, prompt_ids, sampling):
        import asyncio

        (whole,) = await self.sample(prompt_ids, sampling, 1)
        growing = Completion(finish_reason="length")
        for index, token in enumerate(whole.token_ids):
            growing.token_ids.append(token)
            growing.logprobs.append(whole.logprobs[index])
            growing.versions.append(whole.versions[index])
            await asyncio.sleep(0)
            yield growing
        growing.finish_reason = whole.finish_reason
        yield growing
