"""A streamed Messages reply as Anthropic's server-sent events, fed by the endpoint's stream loop
(openai_server.OpenAIEndpoint._stream) with the same text deltas as a chat-completions stream (openai_stream.py:
decoded from the engine's ids as they grow, tool calls held back).

The order is Anthropic's: `message_start` (usage.input_tokens = the prompt), a text block (`content_block_start`,
one `content_block_delta` of type `text_delta` per delta, `content_block_stop`) opened at the first text, then
each parsed tool call as a `tool_use` block whose input arrives whole in one `input_json_delta`, then
`message_delta` (stop_reason, usage.output_tokens) and `message_stop`. The message the official client puts
together (`client.messages.stream(...).get_final_message()`) is the one a plain request answers.
"""
import json

from asyncrl.generator.agents.anthropic_messages import anthropic_message, message_id


def event(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **payload})}\n\n"


class MessageEvents:
    """The events of one streamed Message."""

    def __init__(self, reply_id: str, model: str):
        self.id, self.model = message_id(reply_id), model
        self.text_open = False

    def start(self, prompt_tokens: int) -> list[str]:
        """`message_start`, with the prompt's length as its usage.input_tokens."""
        return [event("message_start", {"message": {
            "id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": prompt_tokens, "output_tokens": 0}}})]

    def text(self, delta: str) -> list[str]:
        events = []
        if not self.text_open:
            self.text_open = True
            events.append(event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}))
        events.append(event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": delta}}))
        return events

    def finish(self, reply: dict, sent: str) -> list[str]:
        """What follows the streamed text once the reply is known (`sent`: the text already streamed)."""
        message = anthropic_message(reply)
        blocks = message["content"]
        text = blocks[0]["text"] if blocks and blocks[0]["type"] == "text" else ""
        events = self.text(text[len(sent):]) if len(text) > len(sent) else []
        index = 0
        if self.text_open:
            events.append(event("content_block_stop", {"index": 0}))
            index = 1
        for block in blocks:
            if block["type"] != "tool_use":
                continue
            events += [event("content_block_start", {"index": index, "content_block": {**block, "input": {}}}),
                       event("content_block_delta", {"index": index, "delta": {
                           "type": "input_json_delta", "partial_json": json.dumps(block["input"])}}),
                       event("content_block_stop", {"index": index})]
            index += 1
        events += [event("message_delta", {"delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                                           "usage": message["usage"]}),
                   event("message_stop", {})]
        return events

    @staticmethod
    def error(body: dict) -> str:
        """A failure mid-stream, as Anthropic's `error` event (`body`: anthropic_messages.anthropic_error's)."""
        return event("error", {"error": body["error"]})
