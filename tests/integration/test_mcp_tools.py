"""Tools served by an MCP server over stdio, through the official `mcp` package on both sides: the server is a tiny
`MCPServer` written here, started by the tool box as a command; its tools are listed with their schemas, called,
and their failures (an error result, a timeout, wrong arguments) reach the model as text."""
import asyncio
import sys

import pytest

from asyncrl.generator.agents.mcp_tools import McpServerError
from asyncrl.generator.agents.tool_calls import HermesToolCallParser, ToolCall
from asyncrl.generator.agents.tools import ToolBox

SERVER = '''
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("calc")


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def crash(reason: str) -> str:
    """Fails on purpose."""
    raise ValueError(f"crashed: {reason}")


@server.tool()
def nap(seconds: float) -> str:
    """Sleeps."""
    time.sleep(seconds)
    return "rested"


if __name__ == "__main__":
    server.run()
'''


def test_an_mcp_servers_tools_are_listed_and_called_and_their_failures_answered(tmp_path):
    path = tmp_path / "calc_server.py"
    path.write_text(SERVER)
    box = ToolBox([], workers=1, timeout_s=3.0, max_output_chars=500, mcp_servers=[f"{sys.executable} {path}"])

    async def scenario():
        await box.start()
        try:
            schemas = dict(box.schemas)
            product = await box.call(ToolCall("multiply", {"a": 6, "b": 7}))
            crashed = await box.call(ToolCall("crash", {"reason": "on purpose"}))
            slow = await box.call(ToolCall("nap", {"seconds": 10}))
            after = await box.call(ToolCall("multiply", {"a": 2, "b": 3}))
            turn = HermesToolCallParser().parse('<tool_call>{"name": "multiply", "arguments": {"a": 1}}</tool_call>',
                                                box.schemas)
            return schemas, product, crashed, slow, after, turn
        finally:
            await box.close()

    schemas, product, crashed, slow, after, turn = asyncio.run(scenario())
    assert sorted(schemas) == ["crash", "multiply", "nap"]
    parameters = schemas["multiply"]["function"]["parameters"]
    assert schemas["multiply"]["function"]["description"] == "Multiply two integers."
    assert set(parameters["properties"]) == {"a", "b"} and sorted(parameters["required"]) == ["a", "b"]
    assert (product.text, product.error) == ("42", None)
    assert crashed.error == "error" and "crash failed: Error executing tool crash" in crashed.text  # the server's words
    assert slow.error == "timeout" and "did not finish within 3 s" in slow.text
    assert after.text == "6"  # the session outlives a timed-out call
    assert [error.reason for error in turn.errors] == ["bad_arguments"]
    assert box.metrics()["rollout/tool_errors/timeout"] == 1.0


def test_a_command_that_is_no_mcp_server_is_refused_at_start(tmp_path):
    box = ToolBox([], workers=1, timeout_s=3.0, max_output_chars=500,
                  mcp_servers=[f"{sys.executable} -c 'print(1)'"])
    with pytest.raises(McpServerError, match="could not be started and listed"):
        asyncio.run(box.start())
