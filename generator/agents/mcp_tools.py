"""Tools served by MCP servers (`tools.mcp_servers`), through the official `mcp` package's client.

Each entry is a command that speaks MCP over stdio (`python my_server.py`, `npx some-mcp-server`); the generator
starts it once, lists its tools and keeps the session for the job. A tool's schema is the server's own: its
name, description and input JSON Schema, in the OpenAI function-calling format the chat template shows. A call's
result is its text content (other content is named, e.g. `[image]`); a result the server marks as an error, a
server that fails or has died, and a call past `tools.timeout_s` all become the text the model reads, counted like
any tool error (tools.py).

The sessions are entered in `start()` and left in `close()`, which must run in the same task (the generator's
main coroutine): the `mcp` client's streams are anyio task groups.
"""
import contextlib
import shlex


class McpServerError(RuntimeError):
    """An MCP server could not be started or listed (the recipe's command is wrong)."""


class McpToolSource:
    """The tools of every server in `commands`: `schemas` after `start()`, `await call(name, arguments)`."""

    def __init__(self, commands: list, timeout_s: float):
        self.commands, self.timeout_s = list(commands), timeout_s
        self.schemas: dict = {}
        self._clients: dict = {}  # tool name -> the mcp.Client that serves it
        self._stack = contextlib.AsyncExitStack()

    async def start(self) -> None:
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        for command in self.commands:
            argv = shlex.split(command)
            try:
                # stdio_client, not the bare parameters: mcp 2.0 (what verifiers pins) takes only a transport
                transport = stdio_client(StdioServerParameters(command=argv[0], args=argv[1:]))
                client = await self._stack.enter_async_context(Client(transport, read_timeout_seconds=self.timeout_s))
                listing = await client.list_tools()
            except Exception as err:
                await self.close()
                raise McpServerError(f"tools.mcp_servers: {command!r} could not be started and listed: "
                                     f"{type(err).__name__}: {err}") from None
            for tool in listing.tools:
                if tool.name in self.schemas:
                    await self.close()
                    raise McpServerError(f"tools.mcp_servers: two servers offer a tool named {tool.name!r}")
                self.schemas[tool.name] = openai_schema(tool)
                self._clients[tool.name] = client

    async def call(self, name: str, arguments: dict) -> tuple[str, bool]:
        """(the result's text, whether the server said it is an error); raises when the server fails."""
        result = await self._clients[name].call_tool(name, arguments, read_timeout_seconds=self.timeout_s)
        return result_text(result.content), bool(result.is_error)

    async def close(self) -> None:
        await self._stack.aclose()


def openai_schema(tool) -> dict:
    parameters = dict(tool.input_schema or {"type": "object", "properties": {}})
    parameters.setdefault("properties", {})
    parameters.setdefault("required", [])
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": parameters}}


def result_text(content: list) -> str:
    parts = []
    for block in content or []:
        text = getattr(block, "text", None)
        parts.append(text if isinstance(text, str) else f"[{getattr(block, 'type', 'content')}]")
    return "\n".join(parts)
