"""The adder taskset's tools: a verifiers Toolset, which verifiers serves over MCP in a process of its own
(`python -m adder_tools`) and the harness calls. The same two tools as the other harness examples."""
import verifiers.v1 as vf

from asyncrl.generator.agents.calculator import evaluate, format_number


class AdderTools(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # advertised bare (`calculator`, not `adder_tools_calculator`): the tool demo's model's name

    @vf.tool
    async def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression: numbers with + - * / and parentheses, e.g. 1234+3678."""
        return format_number(evaluate(expression))  # asyncrl's bounded evaluator: no eval()

    @vf.tool
    async def digit_count(self, number: int) -> int:
        """Count the decimal digits of an integer."""
        return len(str(abs(number)))


if __name__ == "__main__":
    AdderTools.run()
