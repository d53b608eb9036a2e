"""A verifiers taskset (verifiers 0.4, the v1 API), written as verifiers' docs write one: the task's data, a
`@vf.reward` over the trace (the rubric: 1.0 when the final reply is the sum), and the taskset's tools
(adder_tools.py, served over MCP to the harness). verifiers imports it by its id, `adder_v1`; agent.py runs it."""
import verifiers.v1 as vf

from adder_tools import AdderTools


class AdderData(vf.TaskData):
    """One row: the prompt (the asyncrl row's messages) and the answer the reward compares."""
    answer: str


class AdderTask(vf.Task[AdderData]):
    @vf.reward
    async def exact_match(self, trace: vf.Trace) -> float:
        return float(trace.last_reply == self.data.answer)


class AdderConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()


class AdderTaskset(vf.Taskset[AdderTask, AdderConfig]):
    def load(self) -> list[AdderTask]:
        """verifiers' own runs (`vf eval`) would play these; under asyncrl each episode's task is the row's."""
        return [AdderTask(AdderData(idx=0, prompt="add:1234+3678=", answer="4912"), self.config.task)]

    @classmethod
    def toolsets(cls, config: AdderConfig) -> list[vf.Toolset]:
        return [AdderTools(config.tools)]


__all__ = ["AdderTaskset"]
