"""The job's tools: Python functions named in the recipe (`tools.functions`), the built-in ones (`tools.builtins`)
and those of MCP servers (`tools.mcp_servers`, mcp_tools.py), described to the model by their schemas and called
without ever blocking the generator.

A plain function runs in a `ProcessCallPool` (generator/user_code/pool.py) under `tools.timeout_s`, so a hung or
crashing tool costs a worker, never the generator; an `async def` is awaited under the same timeout. Every way a
call can go wrong becomes the text of its tool message, so the model reads what happened and the episode goes on:
a timeout, an exception, a result over `tools.max_output_chars`, and the parser's malformed calls, unknown tools
and wrong arguments. Each is counted by reason (`rollout/tool_errors/<reason>`), and each tool's call time is
measured (`timing/tool/<name>_s`).
"""
import asyncio
import inspect
import json
import time
from collections import Counter
from dataclasses import dataclass

from asyncrl.generator.agents.mcp_tools import McpToolSource
from asyncrl.generator.agents.tool_calls import ToolCall, ToolCallError
from asyncrl.generator.agents.tool_schema import tool_schema
from asyncrl.generator.user_code.loader import load_from_file
from asyncrl.generator.user_code.pool import CallFailed, CallTarget, CallTimeout, PoolBroken, ProcessCallPool


class ToolLoadError(ValueError):
    """A `tools.functions` entry names no function, or one a model cannot call (see tool_schema.py)."""


def load_function(spec: str):
    """`path/to/file.py:function` -> the function (its module runs once per process that loads it)."""
    path, _, name = spec.rpartition(":")
    try:
        fn = load_from_file(path, name, "tools.functions:")
    except FileNotFoundError as err:
        raise ToolLoadError(str(err)) from None
    if not callable(fn):
        raise ToolLoadError(f"tools.functions: {name!r} is not a function in {path}")
    return fn


def build_tool_dispatch(specs: tuple):
    """What a tool worker process runs (a CallTarget factory): `(name, arguments) -> result text`."""
    functions = {load_function(spec).__name__: load_function(spec) for spec in specs}

    def dispatch(name: str, arguments: dict) -> str:
        return result_text(functions[name](**arguments))

    return dispatch


def result_text(result) -> str:
    """What the model reads: a string as it is, anything else as JSON (or its repr when JSON cannot say it)."""
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return repr(result)


@dataclass
class ToolResult:
    text: str
    """The tool message's content."""
    error: str | None = None
    """None, or the reason the call failed (timeout, error, output_too_long, and the parser's reasons)."""


class ToolBox:
    """`schemas` (name -> OpenAI schema) for the chat template and the parser; `await call(call)` -> ToolResult."""

    def __init__(self, specs: list, workers: int, timeout_s: float, max_output_chars: int, builtins: list = (),
                 mcp_servers: list = ()):
        """`specs`: the recipe's `path:function` entries; `builtins`: asyncrl's own async tools (sandbox.py);
        `mcp_servers`: commands of MCP servers over stdio (mcp_tools.py), whose tools join at `start()`."""
        functions = [load_function(spec) for spec in specs] + list(builtins)
        names = [fn.__name__ for fn in functions]
        if len(set(names)) != len(names):
            raise ToolLoadError(f"tools.functions names a tool twice: {sorted(names)}")
        try:
            self.schemas = {fn.__name__: tool_schema(fn) for fn in functions}
        except ValueError as err:
            raise ToolLoadError(f"tools.functions: {err}") from None
        self.async_tools = {fn.__name__: fn for fn in functions if inspect.iscoroutinefunction(fn)}
        plain = tuple(spec for spec, fn in zip(specs, functions) if not inspect.iscoroutinefunction(fn))
        self.pool = ProcessCallPool(CallTarget("asyncrl.generator.agents.tools:build_tool_dispatch", (plain,)),
                                    workers, timeout_s, name="asyncrl-tools") if plain else None
        self.timeout_s, self.max_output_chars = timeout_s, max_output_chars
        self.mcp = McpToolSource(mcp_servers, timeout_s) if mcp_servers else None
        self.errors: Counter = Counter()
        self.seconds: Counter = Counter()  # tool name -> seconds spent in its calls
        self.calls: Counter = Counter()

    async def start(self) -> None:
        """Start the worker processes and the MCP servers; their tools join `schemas`."""
        if self.pool is not None:
            await self.pool.start()
        if self.mcp is not None:
            await self.mcp.start()
            clash = sorted(set(self.mcp.schemas) & set(self.schemas))
            if clash:
                raise ToolLoadError(f"an MCP server offers tools that tools.functions or tools.builtins already "
                                    f"name: {clash}")
            self.schemas.update(self.mcp.schemas)

    async def call(self, call: ToolCall) -> ToolResult:
        started = time.monotonic()
        try:
            if call.name in self.async_tools:
                text = result_text(await asyncio.wait_for(self.async_tools[call.name](**call.arguments),
                                                          self.timeout_s))
            elif self.mcp is not None and call.name in self.mcp.schemas:
                text, is_error = await asyncio.wait_for(self.mcp.call(call.name, call.arguments), self.timeout_s)
                if is_error:
                    return self.failed("error", f"error: {call.name} failed: {text}")
            else:
                text = await self.pool.call(call.name, call.arguments)
        except PoolBroken:
            raise  # every worker dies at start: a broken installation, not this call
        except (CallTimeout, asyncio.TimeoutError):
            return self.failed("timeout", f"error: {call.name} did not finish within {self.timeout_s:g} s")
        except CallFailed as err:
            return self.failed("error", f"error: {call.name} failed: {err}")
        except Exception as err:  # an async tool's own exception
            return self.failed("error", f"error: {call.name} failed: {type(err).__name__}: {err}")
        finally:
            self.seconds[call.name] += time.monotonic() - started
            self.calls[call.name] += 1
        if len(text) > self.max_output_chars:
            return self.failed("output_too_long", f"error: {call.name} returned {len(text)} characters, more than "
                                                  f"the {self.max_output_chars} a tool result may have")
        return ToolResult(text)

    def rejected(self, error: ToolCallError) -> ToolResult:
        """A call the parser refused (malformed, unknown_tool, bad_arguments), answered like a failed one."""
        return self.failed(error.reason, f"error: {error.message}")

    def failed(self, reason: str, text: str) -> ToolResult:
        self.errors[reason] += 1
        return ToolResult(text[:self.max_output_chars], reason)

    def metrics(self) -> dict:
        """Errors by reason, and each tool's mean seconds per call, so far."""
        return {**{f"rollout/tool_errors/{reason}": float(count) for reason, count in sorted(self.errors.items())},
                **{f"timing/tool/{name}_s": self.seconds[name] / self.calls[name] for name in sorted(self.calls)}}

    async def close(self) -> None:
        if self.mcp is not None:
            await self.mcp.close()
        if self.pool is not None:
            await self.pool.close()
