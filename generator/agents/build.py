"""Building the episode runner a job's recipe asks for: the tool environment (tools), a user's environment class
(env.path) or a user's OpenAI-API agent (agent.path), with the chat template checked before any sampling starts:
for appending, or (rollout.turn_samples) per-turn samples when it rewrites earlier turns."""
import logging

from asyncrl.buffer.group import Sampling
from asyncrl.generator.agents.calculator import calculator
from asyncrl.generator.agents.chat_render import ChatAppender, ChatRenderer, resolve_turn_samples
from asyncrl.generator.agents.environment import load_environment_class
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner
from asyncrl.generator.agents.openai_agent import OpenAIAgentRunner, load_agent_function
from asyncrl.generator.agents.openai_server import OpenAIEndpoint
from asyncrl.generator.agents.sandbox import python_tool
from asyncrl.generator.agents.tool_calls import TOOL_CALL_PARSERS
from asyncrl.generator.agents.tool_env import ToolEnvironment
from asyncrl.generator.agents.tools import ToolBox

log = logging.getLogger(__name__)


def wants_episodes(tools_cfg, env_cfg, agent_cfg) -> bool:
    return bool(tools_cfg.offered() or env_cfg.path or agent_cfg.path)


def build_episode_runner(tools_cfg, env_cfg, agent_cfg, rollout_cfg, *, max_model_len: int, max_prompt_tokens: int,
                         tool_workers: int, engine, tokenizer, model_name: str = "asyncrl"):
    """The runner (EpisodeRunner, or OpenAIAgentRunner for agent.path); `start()` it before sampling and
    `close()` it after: the MCP servers' tools join the schemas, and the endpoint serves, only then."""
    budget = EpisodeBudget(rollout_cfg.max_turns, rollout_cfg.max_episode_tokens, max_model_len, max_prompt_tokens)
    mode, why = resolve_turn_samples(rollout_cfg.turn_samples, tokenizer)
    log.info("episodes train as %s: %s", "one sample per model turn" if mode == "per_turn" else
             "one sample per episode", why)
    per_turn = mode == "per_turn"
    renderer = ChatRenderer if per_turn else ChatAppender
    if agent_cfg.path:
        sampling = Sampling(rollout_cfg.temperature, rollout_cfg.top_p, rollout_cfg.top_k, rollout_cfg.max_tokens)
        endpoint = OpenAIEndpoint(engine, model_name, sampling, port=agent_cfg.port)
        return OpenAIAgentRunner(endpoint, load_agent_function(agent_cfg.path, agent_cfg.function), tokenizer,
                                 budget, rollout_cfg.max_tokens, agent_cfg.timeout_s, per_turn=per_turn)
    if tools_cfg.offered():
        builtins = [python_tool(tools_cfg.sandbox)] if "python" in tools_cfg.builtins else []
        builtins += [calculator] if "calculator" in tools_cfg.builtins else []
        toolbox = ToolBox(tools_cfg.functions, tool_workers, tools_cfg.timeout_s, tools_cfg.max_output_chars,
                          builtins=builtins, mcp_servers=tools_cfg.mcp_servers)
        parser = TOOL_CALL_PARSERS[tools_cfg.parser]()
        appender = renderer(tokenizer, tools=toolbox.schemas)
        return EpisodeRunner(engine, tokenizer, appender, lambda: ToolEnvironment(toolbox, parser), budget,
                             env_cfg.step_timeout_s, toolbox=toolbox, per_turn=per_turn)
    environment = load_environment_class(env_cfg.path, env_cfg.name)
    return EpisodeRunner(engine, tokenizer, renderer(tokenizer), environment, budget, env_cfg.step_timeout_s,
                         per_turn=per_turn)
