"""One agent episode as the OpenAI-compatible endpoint sees it: the chat requests of one session become one token
sequence, with nothing re-tokenized.

The first request's messages (and tools) are rendered into the prompt. Each later request must repeat the
history exactly as it was sent and answered, assistant replies included as the endpoint returned them (role,
content, tool calls); only messages after it are new, and they are appended as environment ids (chat_render.py)
after the model's last turn. An agent that edits, drops or reorders earlier messages, changes the tools, or asks
again after a turn that was cut by max_tokens is refused (`SessionRefused`, HTTP 400 with the reason): its
history would no longer be the tokens the model saw, so training on it would be training on a different
conversation. Requests of one session are served one at a time (HTTP 409 for a concurrent one).
"""
import json

from asyncrl.generator.agents.chat_render import ChatAppender
from asyncrl.generator.agents.environment import messages_problem
from asyncrl.generator.agents.episode import Episode
from asyncrl.generator.agents.tool_calls import HermesToolCallParser, ToolCall


class SessionRefused(ValueError):
    """The request cannot continue this episode; `status` is the HTTP status, the message the reason."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def canonical(message: dict) -> tuple:
    """What must match when an agent sends a message back: its role, text and tool calls (name, arguments, id)."""
    calls = []
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        calls.append((call.get("id"), function.get("name"), json.dumps(arguments, sort_keys=True)))
    return message.get("role"), message.get("content") or "", tuple(calls)


def plain_messages(messages: list) -> list:
    """The request's messages as the chat template reads them (tool calls as the template's own format is the
    template's business; content None becomes "")."""
    out = []
    for message in messages:
        entry = {key: value for key, value in message.items() if value is not None}
        entry["content"] = message.get("content") or ""
        out.append(entry)
    return out


class AgentSession:
    def __init__(self, session_id: str, tokenizer, budget, max_tokens: int):
        self.id, self.tokenizer, self.budget, self.max_tokens = session_id, tokenizer, budget, max_tokens
        self.episode: Episode | None = None
        self.history: list = []  # canonical messages sent and answered so far
        self.tools = None
        self.appender = None
        self.busy = False
        self.requests = 0
        self.parser = HermesToolCallParser()

    def sequence_for(self, messages: list, tools) -> list:
        """The token ids to sample the next model turn from; raises SessionRefused."""
        if not isinstance(messages, list) or not messages:
            raise SessionRefused(400, "messages must be a non-empty list")
        problem = messages_problem(plain_messages(messages))
        if problem:
            raise SessionRefused(400, problem)
        if self.requests >= self.budget.max_turns:
            raise SessionRefused(400, f"the episode has used its rollout.max_turns={self.budget.max_turns} turns")
        try:
            if self.episode is None:
                return self._open(messages, tools)
            return self._continue(messages, tools)
        except SessionRefused:
            raise
        except Exception as err:  # the chat template could not render them (TemplateCannotAppend, a template error)
            raise SessionRefused(400, f"the messages cannot be rendered: {type(err).__name__}: {err}") from None

    def _open(self, messages: list, tools) -> list:
        self.tools = tools or None
        self.appender = ChatAppender(self.tokenizer, tools=list(tools or []))
        prompt = self.appender.prompt_ids(plain_messages(messages))
        if len(prompt) > self.budget.max_prompt_tokens:
            raise SessionRefused(400, f"the prompt is {len(prompt)} tokens > data.max_prompt_tokens="
                                      f"{self.budget.max_prompt_tokens}")
        self.episode = Episode(prompt_len=len(prompt), sequence=list(prompt))
        self.history = [canonical(message) for message in messages]
        return list(prompt)

    def _continue(self, messages: list, tools) -> list:
        episode = self.episode
        if (tools or None) != self.tools:
            raise SessionRefused(400, "the tools changed in the middle of the episode")
        if episode.finish_reason != "stop":
            raise SessionRefused(400, f"the last turn ended with {episode.finish_reason!r}, so the conversation "
                                      f"cannot go on from it")
        sent = [canonical(message) for message in messages]
        if sent[:len(self.history)] != self.history:
            at = next((i for i, (a, b) in enumerate(zip(sent, self.history)) if a != b), len(sent))
            raise SessionRefused(400, f"message {at} differs from what this episode sent and was answered: an agent "
                                      f"must send its history back unchanged (docs/agents.md)")
        new = plain_messages(messages[len(self.history):])
        if not new:
            raise SessionRefused(400, "no new message after the last answer")
        appended = self.appender.append_ids(new)
        limit = self.budget.max_episode_tokens or self.budget.max_model_len
        if (episode.after_prompt() + len(appended) >= limit
                or len(episode.sequence) + len(appended) >= self.budget.max_model_len):
            episode.finish_reason = "max_episode_tokens"
            raise SessionRefused(400, "the episode has used its token budget (rollout.max_episode_tokens or the "
                                      "model's positions)")
        episode.add_env_turn(appended)
        self.history = sent
        return list(episode.sequence)

    def room(self) -> int:
        episode = self.episode
        limit = self.budget.max_episode_tokens or self.budget.max_model_len
        return min(self.max_tokens, limit - episode.after_prompt(), self.budget.max_model_len - len(episode.sequence))

    def record(self, completion) -> dict:
        """Add the sampled turn; returns the assistant message the endpoint answers with (and will expect back)."""
        episode = self.episode
        episode.add_model_turn(completion, self.room(), self.tokenizer)
        self.requests += 1
        text = episode.last_text
        message = {"role": "assistant", "content": text}
        if self.tools:
            turn = self.parser.parse(text, {tool["function"]["name"]: tool for tool in self.tools})
            calls = [item for item in turn.items if isinstance(item, ToolCall)]
            if calls:
                episode.tool_calls += len(calls)
                message = {"role": "assistant", "content": turn.content or None, "tool_calls": [
                    {"id": f"call_{self.id[-8:]}_{episode.turns}_{index}", "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    for index, call in enumerate(calls)]}
        self.history.append(canonical(message))
        return message
