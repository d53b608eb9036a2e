"""Anthropic's Messages API as the chat requests the endpoint already serves: a pure function each way.

`chat_request` turns a `POST /v1/messages` body into the chat-completions body the OpenAI path takes (system
prompt first, `tool_use` blocks as `tool_calls`, each `tool_result` block a `tool` message, tool schemas in the
OpenAI function format), so the same AgentSession renders it with the same chat template and checks its history
with the same rules: an Anthropic agent's episode is the token sequence an OpenAI agent's would be, and nothing is
re-tokenized. `anthropic_message` turns the endpoint's chat.completion back into a Message object, the text
first, then the tool calls as `tool_use` blocks with the ids the session expects back.

What the model cannot be asked to do is refused rather than ignored, so the agent learns it at once: images and
documents (a text model), thinking blocks and `thinking` (the job's template decides about reasoning),
`stop_sequences` (the engine samples to the end of the turn), a `tool_choice` other than `auto` (nothing forces a
call), server tools. `cache_control`, `metadata` and the sampling fields are ignored: sampling is the job's.
"""
import json

from asyncrl.generator.agents.openai_session import SessionRefused

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
"""The chat finish_reason -> Anthropic's stop_reason; any other (malformed_tool_call) passes through as it is."""

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 409: "invalid_request_error"}
"""HTTP status -> Anthropic's error type; any other status is an `api_error`."""


def refuse(message: str, param: str, cause: str = "bad_messages"):
    raise SessionRefused(400, message, cause, param)


def text_of(blocks, where: str) -> str:
    """The text of a string or a list of `text` blocks (joined by a blank line), anything else refused."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        refuse(f"{where} must be a string or a list of text blocks, got {type(blocks).__name__}", where)
    texts = []
    for index, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            refuse(f"{where}[{index}] must be a text block, got {kind!r}: only text reaches a text model", where)
        texts.append(block["text"])
    return "\n\n".join(texts)


def tool_message(block: dict, where: str) -> dict:
    """A `tool_result` block as the chat `tool` message; `is_error` is told to the model as an `Error: ` prefix."""
    if not isinstance(block.get("tool_use_id"), str):
        refuse(f"{where}.tool_use_id must be the id of the tool_use block it answers", where)
    content = block.get("content")
    text = "" if content is None else text_of(content, f"{where}.content")
    if block.get("is_error"):
        text = f"Error: {text}"
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": text}


def user_messages(content, where: str) -> list[dict]:
    """A user turn: its text as a user message, each tool_result as a tool message, in the order written."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        refuse(f"{where}.content must be a string or a list of blocks, got {type(content).__name__}", where)
    out, texts = [], []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": "\n\n".join(texts)})
                texts = []
            out.append(tool_message(block, f"{where}.content[{index}]"))
        else:
            refuse(f"{where}.content[{index}] is a {kind!r} block: a user turn takes text and tool_result blocks "
                   f"(images and documents are not supported)", where)
    if texts:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def assistant_message(content, where: str) -> dict:
    """An assistant turn: its text blocks joined, its tool_use blocks as tool_calls."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        refuse(f"{where}.content must be a string or a list of blocks, got {type(content).__name__}", where)
    texts, calls = [], []
    for index, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str) \
                    or not isinstance(block.get("input"), dict):
                refuse(f"{where}.content[{index}] must be a tool_use block with an id, a name and an input object",
                       where)
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block["input"])}})
        else:
            refuse(f"{where}.content[{index}] is a {kind!r} block: an assistant turn takes text and tool_use blocks "
                   f"(thinking blocks are not supported)", where)
    message = {"role": "assistant", "content": "".join(texts)}
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(system, messages) -> list[dict]:
    """The system prompt and Anthropic messages as chat messages."""
    if not isinstance(messages, list) or not messages:
        refuse("messages must be a non-empty list", "messages")
    out = []
    if system is not None:
        text = text_of(system, "system")
        if text:
            out.append({"role": "system", "content": text})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            refuse(f"{where} must be an object whose role is 'user' or 'assistant'", "messages")
        if message["role"] == "user":
            out += user_messages(message.get("content"), where)
        else:
            out.append(assistant_message(message.get("content"), where))
    return out


def chat_tools(tools) -> list[dict] | None:
    """Anthropic tool definitions as OpenAI function tools, so the chat template renders them as it renders an
    OpenAI agent's."""
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        refuse(f"tools must be a list, got {type(tools).__name__}", "tools", "bad_parameter")
    out = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" \
                or not isinstance(tool.get("name"), str) or not isinstance(tool.get("input_schema"), dict):
            refuse(f"tools[{index}] must be {{name, description, input_schema}} (server tools are not supported)",
                   "tools", "bad_parameter")
        function = {"name": tool["name"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool["input_schema"]
        out.append({"type": "function", "function": function})
    return out


def chat_request(body: dict) -> dict:
    """A Messages request `body` as the chat-completions body (messages, tools, max_tokens); raises
    SessionRefused naming the field at fault."""
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        refuse(f"max_tokens is required and must be a positive integer, got {max_tokens!r}", "max_tokens",
               "bad_parameter")
    if body.get("stop_sequences"):
        refuse("stop_sequences are not supported: the engine samples each turn to its end", "stop_sequences",
               "bad_parameter")
    thinking = body.get("thinking")
    if thinking is not None and (not isinstance(thinking, dict) or thinking.get("type") != "disabled"):
        refuse("thinking is not supported: the job's chat template decides about reasoning", "thinking",
               "bad_parameter")
    choice = body.get("tool_choice")
    if choice is not None and (not isinstance(choice, dict) or choice.get("type") != "auto"):
        refuse(f"tool_choice must be {{\"type\": \"auto\"}} or absent, got {choice!r}: nothing can force the model "
               f"to call a tool", "tool_choice", "bad_parameter")
    return {"messages": chat_messages(body.get("system"), body.get("messages")), "tools": chat_tools(body.get("tools")),
            "max_tokens": max_tokens}


def message_id(reply_id: str) -> str:
    """The Message id of the chat.completion `reply_id` (the session's turn)."""
    return "msg_" + reply_id.removeprefix("chatcmpl-")


def content_blocks(message: dict) -> list[dict]:
    """A chat assistant message as content blocks: its text (when there is any), then its tool calls."""
    blocks = [{"type": "text", "text": message["content"]}] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        blocks.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                       "input": json.loads(call["function"]["arguments"])})
    return blocks


def anthropic_message(reply: dict) -> dict:
    """The endpoint's chat.completion `reply` as an Anthropic Message."""
    choice = reply["choices"][0]
    return {"id": message_id(reply["id"]), "type": "message", "role": "assistant", "model": reply["model"],
            "content": content_blocks(choice["message"]),
            "stop_reason": STOP_REASONS.get(choice["finish_reason"], choice["finish_reason"]), "stop_sequence": None,
            "usage": {"input_tokens": reply["usage"]["prompt_tokens"],
                      "output_tokens": reply["usage"]["completion_tokens"]}}


HISTORY_NOTE = (" (messages[i] counts the request as chat messages: the system prompt is messages[0] and each "
                "tool_result block a message of its own)")


def anthropic_error(message: str, kind: str, cause: str, status: int, param: str | None) -> dict:
    """Anthropic's error object; `cause` (openai_session.REFUSAL_CAUSES) and `param` ride along as extra fields.
    `kind` is the OpenAI path's error type, unused: Anthropic's follows from the status."""
    if cause in ("history_edited", "reply_omitted"):
        message += HISTORY_NOTE
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message,
                                       "cause": cause, "param": param}}
