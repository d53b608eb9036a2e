"""The built-in tool environment: one `Environment` (environment.py) that runs the model's tool calls.

Each step parses the model's turn with the job's tool-call parser (tool_calls.py). No call: the model answered,
the episode is done, and the job's reward function scores that answer. Calls: each runs through the `ToolBox`
(tools.py), in the order written, and each result, or the error the model gets instead, becomes one `tool`
message; the model reads them in its next turn.
"""
from asyncrl.generator.agents.environment import StepResult
from asyncrl.generator.agents.tool_calls import ToolCall


class ToolEnvironment:
    def __init__(self, toolbox, parser):
        self.toolbox, self.parser = toolbox, parser

    async def reset(self, row: dict):
        return None  # the row's prompt, rendered with the tools' schemas by the episode's ChatAppender

    async def step(self, text: str) -> StepResult:
        turn = self.parser.parse(text, self.toolbox.schemas)
        if not turn.wants_tools:
            return StepResult(done=True)
        messages = []
        for item in turn.items:
            if isinstance(item, ToolCall):
                result = await self.toolbox.call(item)
                messages.append({"role": "tool", "name": item.name, "tool_call_id": item.call_id,
                                 "content": result.text})
            else:
                result = self.toolbox.rejected(item)
                messages.append({"role": "tool", "name": item.name or "unknown", "content": result.text})
        return StepResult(messages=messages, tool_calls=len(turn.items))
