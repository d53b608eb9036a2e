"""Token ids for an episode's environment turns, from the chat template alone: what the model wrote is never
decoded and re-encoded.

An episode is one token sequence. After a model turn that ended on its stop token, the next messages (tool
results, an environment's observation) are rendered by the chat template as they would follow an assistant turn,
and only their ids are appended, ending with the template's generation prompt for the next model turn. The
rendering is taken from a probe conversation: with a user message U and an assistant message A,

    render(U, A, *new, generation prompt)  must start with  render(U, A)

(a template that rewrites earlier turns when more follow, as Qwen3's strips <think> from history, cannot append:
with rollout.turn_samples=episode it is refused when the episode runner is built, with the reason; `auto` and
`per_turn` train each model turn as its own sample instead, its prompt rendered anew by `ChatRenderer` from the
whole history, episode.py), and render(U, A) must end A's turn with the
text of the stop token the engine stops on, maybe followed by separator text (Qwen's "<|im_end|>\\n"). The ids
appended after a model turn are those of that separator plus the new messages' rendering.

The appended text is tokenized on its own, so the sequence can differ from what tokenizing the whole
conversation at once would give at the seam; the learner trains on exactly the ids the engine saw, which is
what matters (docs/agents.md, "Tokens").
"""
PROBE_USER = "asyncrl-probe-user"
PROBE_ANSWER = "asyncrl-probe-answer"
PROBE_REASONING = "<think>asyncrl-probe-reasoning</think>"
"""The probe's answer opens with reasoning, so a template that strips it from earlier turns (Qwen3's) shows it."""


class TemplateCannotAppend(ValueError):
    """The chat template cannot render a turn as an append to the conversation; the message says why."""


TURN_SAMPLES_HINT = ("; set rollout.turn_samples=per_turn (or auto) to train each model turn as its own sample against "
                     "the prompt the template renders for it (docs/agents.md, \"Reasoning templates\")")


class ChatRenderer:
    """Renders a conversation's prompt ids with the chat template: each model turn's whole prompt, as
    rollout.turn_samples=per_turn renders it. `tools`: OpenAI tool schemas the template shows the model, a list
    or a name -> schema mapping read at each render (MCP servers' tools join the tool box's mapping when it
    starts); None: none."""

    def __init__(self, tokenizer, tools=None):
        self.tokenizer, self._tools = tokenizer, tools
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateCannotAppend("the tokenizer has no chat template, so an environment's messages cannot "
                                       "be rendered; give the model directory a chat_template")
        eos = tokenizer.eos_token
        if not eos:
            raise TemplateCannotAppend("the tokenizer has no eos token: a model turn could not end")
        self.stop_text = eos

    @property
    def tools(self) -> list | None:
        tools = list(self._tools.values()) if isinstance(self._tools, dict) else self._tools
        return tools or None

    def render(self, messages: list, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=generation_prompt)

    def encode(self, text: str) -> list:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt_ids(self, messages: list) -> list:
        """The messages (an episode's opening, or with per-turn samples its whole history), rendered with the tools
        and the generation prompt."""
        return self.encode(self.render(messages, generation_prompt=True))


class ChatAppender(ChatRenderer):
    """Renders an episode's prompt and the ids appended after each model turn (refusing, when built, a template
    that cannot append)."""

    def __init__(self, tokenizer, tools=None):
        super().__init__(tokenizer, tools)
        self.separator = self._probe_separator()

    def append_ids(self, messages: list) -> list:
        """The ids that follow a model turn ended by the stop token: the template's separator after it, the new
        messages, and the generation prompt of the next model turn."""
        base = self.render(self._probe(), generation_prompt=False)
        full = self.render(self._probe() + list(messages), generation_prompt=True)
        if not full.startswith(base):  # checked at start too; a template can depend on the messages' contents
            raise TemplateCannotAppend(f"rendering {len(messages)} more message(s) changed the earlier part of the "
                                       f"conversation")
        return self.encode(self.separator + full[len(base):])

    @staticmethod
    def _probe() -> list:
        return [{"role": "user", "content": PROBE_USER},
                {"role": "assistant", "content": PROBE_REASONING + PROBE_ANSWER}]

    def _probe_separator(self) -> str:
        """The text the template puts after the stop token that ends an assistant turn (refusing templates that
        cannot append)."""
        base = self.render(self._probe(), generation_prompt=False)
        at = base.rfind(PROBE_ANSWER)
        if at < 0:
            raise TemplateCannotAppend("the chat template drops the assistant's answer from the conversation")
        tail = base[at + len(PROBE_ANSWER):]
        if not tail.startswith(self.stop_text):
            raise TemplateCannotAppend(
                f"the chat template ends an assistant turn with {tail[:40]!r}, not with the stop token "
                f"{self.stop_text!r} the engine stops on, so the turn the model ended cannot be continued"
                + TURN_SAMPLES_HINT)
        probe_tool = [{"role": "user", "content": PROBE_USER}]
        full = self.render(self._probe() + probe_tool, generation_prompt=True)
        if not full.startswith(base):
            raise TemplateCannotAppend("rendering one more message changes the earlier part of the conversation "
                                       "(the template rewrites history, as templates that strip reasoning from "
                                       "earlier turns do), so turns cannot be appended" + TURN_SAMPLES_HINT)
        return tail[len(self.stop_text):]


def resolve_turn_samples(setting: str, tokenizer) -> tuple[str, str]:
    """(`episode` or `per_turn`, why) for rollout.turn_samples=`setting` with this tokenizer's chat template;
    raises TemplateCannotAppend when neither can work (`auto` is `episode` already when the algorithm cannot
    train per-turn samples: configs/run_config.py check_episodes)."""
    if setting == "per_turn":
        ChatRenderer(tokenizer)
        return "per_turn", "rollout.turn_samples=per_turn"
    try:
        ChatAppender(tokenizer)
    except TemplateCannotAppend as err:
        if setting == "episode" or str(err).startswith("the tokenizer has no"):
            raise
        return "per_turn", f"rollout.turn_samples=auto and {str(err).split(TURN_SAMPLES_HINT)[0]}"
    return "episode", f"rollout.turn_samples={setting} and the chat template renders each turn as an append"
