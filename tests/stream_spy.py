"""A spy on a real streaming engine, for the agent endpoint's streaming tests: it passes everything through and notes
how many tokens the completion held at each delivery. vLLM merges the deltas a busy frontend has not yet collected
(its output collector), so how many deliveries a five-token reply arrives in depends on the machine's load; what the
endpoint owes is one text chunk per delivery that adds text, sent as it arrives. The spy lets a test check exactly
that, and retry until vLLM has delivered in pieces, instead of counting chunks and hoping."""
from contextlib import aclosing


class DeliverySpy:
    def __init__(self, engine):
        self.engine = engine
        self.deliveries: list = []  # tokens in the completion at each delivery, the last stream's

    def __getattr__(self, name):
        return getattr(self.engine, name)

    async def sample_stream(self, prompt_ids: list, sampling):
        self.deliveries = []
        async with aclosing(self.engine.sample_stream(prompt_ids, sampling)) as growing:
            async for completion in growing:
                self.deliveries.append(len(completion.token_ids))
                yield completion

    def text_growths(self, token_ids: list, tokenizer) -> int:
        """How many of the last stream's deliveries made its decoded text longer: the chunks the endpoint owes."""
        texts = [tokenizer.decode(token_ids[:count], skip_special_tokens=True) for count in self.deliveries]
        return sum(1 for before, after in zip(["", *texts], texts) if len(after) > len(before))
