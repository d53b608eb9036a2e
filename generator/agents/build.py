"""Building the episode runner a job's recipe asks for: the tool environment (tools.functions) or a user's
environment class (env.path), with the chat template checked for appending before any sampling starts."""
from asyncrl.generator.agents.chat_render import ChatAppender
from asyncrl.generator.agents.environment import load_environment_class
from asyncrl.generator.agents.episode import EpisodeBudget, EpisodeRunner
from asyncrl.generator.agents.sandbox import python_tool
from asyncrl.generator.agents.tool_calls import TOOL_CALL_PARSERS
from asyncrl.generator.agents.tool_env import ToolEnvironment
from asyncrl.generator.agents.tools import ToolBox


def wants_episodes(tools_cfg, env_cfg) -> bool:
    return bool(tools_cfg.offered() or env_cfg.path)


def build_episode_runner(tools_cfg, env_cfg, rollout_cfg, *, max_model_len: int, max_prompt_tokens: int,
                         tool_workers: int, engine, tokenizer) -> EpisodeRunner:
    """The runner; its `toolbox` (if any) must be started before and closed after sampling: the MCP servers'
    tools join the schemas the appender renders only then."""
    budget = EpisodeBudget(rollout_cfg.max_turns, rollout_cfg.max_episode_tokens, max_model_len, max_prompt_tokens)
    if tools_cfg.offered():
        builtins = [python_tool(tools_cfg.sandbox)] if "python" in tools_cfg.builtins else []
        toolbox = ToolBox(tools_cfg.functions, tool_workers, tools_cfg.timeout_s, tools_cfg.max_output_chars,
                          builtins=builtins, mcp_servers=tools_cfg.mcp_servers)
        parser = TOOL_CALL_PARSERS[tools_cfg.parser]()
        appender = ChatAppender(tokenizer, tools=toolbox.schemas)
        return EpisodeRunner(engine, tokenizer, appender, lambda: ToolEnvironment(toolbox, parser), budget,
                             env_cfg.step_timeout_s, toolbox=toolbox)
    environment = load_environment_class(env_cfg.path, env_cfg.name)
    return EpisodeRunner(engine, tokenizer, ChatAppender(tokenizer), environment, budget, env_cfg.step_timeout_s)
