"""One agent episode as the OpenAI-compatible endpoint sees it: the chat requests of one session become one token
sequence, with nothing re-tokenized.

The first request's messages (and tools) are rendered into the prompt. Each later request must repeat the
history exactly as it was sent and answered, assistant replies included as the endpoint returned them (role,
content, tool calls); only messages after it are new, and they are appended as environment ids (chat_render.py)
after the model's last turn. An agent that edits, drops or reorders earlier messages, changes the tools, or asks
again after a turn that was cut by max_tokens is refused (`SessionRefused`, HTTP 400 with the reason): its
history would no longer be the tokens the model saw, so training on it would be training on a different
conversation. Requests of one session are served one at a time (HTTP 409 for a concurrent one).

With per-turn samples (rollout.turn_samples=per_turn, for a template that rewrites earlier turns, as Qwen3's
strips <think> from them) the rule on the history is the same: the request's messages must repeat what was sent
and answered. What changes is the prompt of the new turn: the chat template's render of the whole request, not an
append, so earlier assistant turns read as the template rewrites them; each turn trains as its own sample against
exactly those ids (episode.py).

Every refusal has a cause from REFUSAL_CAUSES: it is the error object's `code` and the endpoint counts it in
`rollout/http_refusals/<cause>`, so a user sees which rule their harness breaks without reading the log. A
history that differs is told by index, with what was expected (`history_mismatch`): the common mistakes
(an agent that drops the reply it got, or rebuilds it differently) read differently from a real edit.
"""
import json

from asyncrl.generator.agents.chat_render import ChatAppender, ChatRenderer
from asyncrl.generator.agents.environment import messages_problem
from asyncrl.generator.agents.episode import Episode
from asyncrl.generator.agents.tool_calls import HermesToolCallParser, ToolCall


REFUSAL_CAUSES = ("unknown_key", "bad_body", "concurrent_request", "bad_parameter", "bad_messages", "turn_limit",
                  "prompt_too_long", "cannot_render", "tools_changed", "after_cut", "history_edited",
                  "reply_omitted", "nothing_new", "token_budget")
"""Why the endpoint refuses a request; a fixed set, so the metrics family stays bounded (buffer/fleet_stats.py)."""


class SessionRefused(ValueError):
    """The request cannot continue this episode; `status` is the HTTP status, `cause` one of REFUSAL_CAUSES,
    `param` the request field at fault (or None), the message the reason."""

    def __init__(self, status: int, message: str, cause: str, param: str | None = None):
        if cause not in REFUSAL_CAUSES:
            raise ValueError(f"refusal cause {cause!r} is not one of {REFUSAL_CAUSES}")
        super().__init__(message)
        self.status, self.cause, self.param = status, cause, param


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


def describe(message: tuple, limit: int = 80) -> str:
    """A canonical message, short enough for an error message: its role, text and tool calls."""
    role, content, calls = message
    text = content if len(content) <= limit else content[:limit] + "..."
    parts = [f"role {role!r}", f"content {text!r}"]
    if calls:
        parts.append("tool calls " + ", ".join(f"{name}({arguments})" for _, name, arguments in calls))
    return "{" + ", ".join(parts) + "}"


def history_mismatch(sent: list, history: list, replies: dict) -> tuple[str, str] | None:
    """Where the canonical messages `sent` stop repeating `history` (what this episode was sent and answered),
    as (cause, message), or None when they repeat it. `replies`: history index -> the turn (1-based) whose
    reply the endpoint returned there. An agent that sends something else where a reply belongs has omitted it
    (the usual bug: appending the next user or tool message without the assistant message); one that sends an
    assistant message that differs has rebuilt or edited it."""
    at = next((i for i, (a, b) in enumerate(zip(sent, history)) if a != b), None)
    if at is None:
        if len(sent) >= len(history):
            return None
        at = len(sent)
    turn = replies.get(at)
    got = describe(sent[at]) if at < len(sent) else "nothing"
    if turn is not None and (at >= len(sent) or sent[at][0] != "assistant"):
        return "reply_omitted", (f"the request omits the assistant reply of turn {turn} (expected messages[{at}] to "
                                 f"be it, {describe(history[at])}; got {got}): send each reply back as it was "
                                 f"returned (docs/agents.md)")
    if at >= len(sent):
        return "history_edited", (f"the request stops at messages[{at - 1}]: it leaves out messages[{at}], "
                                  f"expected {describe(history[at])}: an agent must send its history back unchanged "
                                  f"(docs/agents.md)")
    if turn is not None:
        what = f"the reply this episode's turn {turn} returned"
    else:
        what = "what this episode was sent there"
    return "history_edited", (f"messages[{at}] ({sent[at][0]}) differs from {what}: "
                              f"expected {describe(history[at])}, got {got}: an agent must send its history back "
                              f"unchanged (docs/agents.md)")


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
    def __init__(self, session_id: str, tokenizer, budget, max_tokens: int, per_turn: bool = False):
        self.id, self.tokenizer, self.budget, self.max_tokens = session_id, tokenizer, budget, max_tokens
        self.per_turn = per_turn  # rollout.turn_samples resolved to per_turn: each turn's prompt is rendered anew
        self.episode: Episode | None = None
        self.history: list = []  # canonical messages sent and answered so far
        self.replies: dict = {}  # history index -> the turn (1-based) whose reply sits there
        self.tools = None
        self.appender = None
        self.busy = False
        self.requests = 0
        self.parser = HermesToolCallParser()

    def sequence_for(self, messages: list, tools) -> list:
        """The token ids to sample the next model turn from; raises SessionRefused."""
        if not isinstance(messages, list) or not messages:
            raise SessionRefused(400, "messages must be a non-empty list", "bad_messages", "messages")
        problem = messages_problem(plain_messages(messages))
        if problem:
            raise SessionRefused(400, problem, "bad_messages", "messages")
        if self.requests >= self.budget.max_turns:
            raise SessionRefused(400, f"the episode has used its rollout.max_turns={self.budget.max_turns} turns",
                                 "turn_limit")
        try:
            if self.episode is None:
                return self._open(messages, tools)
            return self._continue(messages, tools)
        except SessionRefused:
            raise
        except Exception as err:  # the chat template could not render them (TemplateCannotAppend, a template error)
            raise SessionRefused(400, f"the messages cannot be rendered: {type(err).__name__}: {err}",
                                 "cannot_render", "messages") from None

    def _open(self, messages: list, tools) -> list:
        self.tools = tools or None
        self.appender = (ChatRenderer if self.per_turn else ChatAppender)(self.tokenizer, tools=list(tools or []))
        prompt = self.appender.prompt_ids(plain_messages(messages))
        if len(prompt) > self.budget.max_prompt_tokens:
            raise SessionRefused(400, f"the prompt is {len(prompt)} tokens > data.max_prompt_tokens="
                                      f"{self.budget.max_prompt_tokens}", "prompt_too_long", "messages")
        self.episode = Episode(prompt_len=len(prompt), sequence=list(prompt), per_turn=self.per_turn)
        self.history = [canonical(message) for message in messages]
        return list(prompt)

    def _continue(self, messages: list, tools) -> list:
        episode = self.episode
        if (tools or None) != self.tools:
            raise SessionRefused(400, "the tools changed in the middle of the episode: send the first request's "
                                      "tools with every request", "tools_changed", "tools")
        if episode.finish_reason != "stop":
            raise SessionRefused(400, f"the last turn ended with {episode.finish_reason!r}, so the conversation "
                                      f"cannot go on from it", "after_cut")
        sent = [canonical(message) for message in messages]
        mismatch = history_mismatch(sent, self.history, self.replies)
        if mismatch is not None:
            raise SessionRefused(400, mismatch[1], mismatch[0], "messages")
        new = plain_messages(messages[len(self.history):])
        if not new:
            raise SessionRefused(400, "no new message after the last answer", "nothing_new", "messages")
        if self.per_turn:  # the next turn's prompt: the template's render of the whole conversation
            appended = self.appender.prompt_ids(plain_messages(messages))
            grown = len(appended) - len(episode.sequence)
        else:
            appended = self.appender.append_ids(new)
            grown = len(appended)
        limit = self.budget.max_episode_tokens or self.budget.max_model_len
        if (episode.after_prompt() + grown >= limit
                or len(episode.sequence) + grown >= self.budget.max_model_len):
            episode.finish_reason = "max_episode_tokens"
            raise SessionRefused(400, "the episode has used its token budget (rollout.max_episode_tokens or the "
                                      "model's positions)", "token_budget")
        if self.per_turn:
            episode.rebase(appended)
        else:
            episode.add_env_turn(appended)
        self.history = sent
        return list(episode.sequence)

    def room(self) -> int:
        episode = self.episode
        limit = self.budget.max_episode_tokens or self.budget.max_model_len
        return min(self.max_tokens, limit - episode.after_prompt(), self.budget.max_model_len - len(episode.sequence))

    def record(self, completion) -> tuple[dict, list]:
        """Add the sampled turn; returns the assistant message the endpoint answers with (and will expect back),
        and the reasons (tool_calls.py) of the tool calls the model got wrong in it. Those are not passed on: the
        agent could not run them, and the OpenAI API has no place for a call that is not one."""
        episode = self.episode
        episode.add_model_turn(completion, self.room(), self.tokenizer)
        self.requests += 1
        text = episode.last_text
        message, errors = {"role": "assistant", "content": text}, []
        if self.tools:
            turn = self.parser.parse(text, {tool["function"]["name"]: tool for tool in self.tools})
            errors = [item.reason for item in turn.errors]
            calls = [item for item in turn.items if isinstance(item, ToolCall)]
            if calls:
                episode.tool_calls += len(calls)
                message = {"role": "assistant", "content": turn.content or None, "tool_calls": [
                    {"id": f"call_{self.id[-8:]}_{episode.turns}_{index}", "type": "function",
                     "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                    for index, call in enumerate(calls)]}
        self.replies[len(self.history)] = episode.turns
        self.history.append(canonical(message))
        return message, errors

    def returned(self, message: dict) -> None:
        """The last turn's reply reached the client as `message` (a stream's text, openai_stream.py): that is
        what the next request must send back. Its tokens are recorded as they were sampled."""
        self.history[-1] = canonical(message)

    def mark(self) -> tuple:
        """Where the episode stands before a request, for `undo`."""
        episode = self.episode
        if episode is not None and self.per_turn:  # a rebase replaces the sequence: keep the whole of it
            return ((list(episode.sequence), list(episode.logprobs), list(episode.versions), list(episode.loss_mask)),
                    episode.env_tokens, list(self.history))
        return (None if episode is None else len(episode.sequence), None if episode is None else episode.env_tokens,
                list(self.history))

    def undo(self, mark: tuple) -> None:
        """Forget a request whose turn was never recorded (the engine failed, the client left mid-stream): the
        messages it appended go, so the agent can send the same request again. The model's tokens are untouched:
        a request that recorded its turn is never undone."""
        length, env_tokens, history = mark
        if length is None:
            self.episode, self.history, self.tools, self.appender = None, [], None, None
            return
        episode = self.episode
        if isinstance(length, tuple):  # per-turn: the sequence as it was
            episode.sequence, episode.logprobs, episode.versions, episode.loss_mask = length
            episode.env_tokens, self.history = env_tokens, history
            return
        kept = length - episode.prompt_len
        del episode.sequence[length:], episode.logprobs[kept:], episode.versions[kept:], episode.loss_mask[kept:]
        episode.env_tokens, self.history = env_tokens, history
