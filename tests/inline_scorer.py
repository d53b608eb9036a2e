"""A reward scorer that scores in the calling task (exact match of the stripped text against the ground truth),
for tests that run episodes or a rollout loop without the scorer's worker processes."""


class InlineScorer:
    seconds, calls = 0.0, 0

    def error_counts(self):
        return {}

    async def score(self, data_source, text, ground_truth, extra_info, prompt_id="?", prompt=None):
        return float(text.strip() == ground_truth), {}
