"""`RunConfig`: every part's config in one tree, loaded from a YAML recipe plus dotlist overrides.

Only the stdlib and omegaconf are imported here, so `asyncrl <cmd> --help` and `--dry-run` stay fast.
"""
import hashlib
import json
import warnings
from dataclasses import asdict, dataclass, field
from typing import Optional

from asyncrl.algos.config import GROUP_ADVANTAGES, AlgoConfig
from asyncrl.buffer.config import BufferConfig
from asyncrl.configs.sections import DemoConfig, EvalConfig, JobConfig, ModelConfig, RewardConfig, RewardServerConfig
from asyncrl.data.config import DataConfig
from asyncrl.generator.config import AgentConfig, EnvConfig, GeneratorConfig, RolloutConfig, ToolsConfig
from asyncrl.learner.config import CriticConfig, LearnerConfig, PRMConfig, SFTConfig
from asyncrl.security.config import SecurityConfig
from asyncrl.telemetry.config import TelemetryConfig
from asyncrl.weightsync.config import WeightSyncConfig

SHARED_SECTIONS = ("model", "data", "reward", "rollout", "tools", "env", "agent", "buffer", "demo", "weightsync")
"""Sections the learner and every generator must agree on; their hash is checked when a generator joins."""
LEARNER_ONLY_KEYS = (
    "buffer.done_grace_s",  # how long the learner (and `asyncrl run`) waits at the end (buffer/done.py)
    "buffer.queue_groups", "buffer.queue_mb",  # the bounds of the zmq learner's queue
    "buffer.redis.reclaim_idle_s", "buffer.redis.appendfsync",  # the learner's stream reclaim; set by the learner
    "data.epochs", "data.deal_timeout_s",  # the learner's dealer (generators hear the deal timeout in the run info)
    "weightsync.host", "weightsync.advertise", "weightsync.catchup_port", "weightsync.broadcast_port",  # where the
    # learner's servers bind and what they advertise: generators read the addresses from each announcement
    "weightsync.keep_versions", "weightsync.bucket_mb", "weightsync.catchup_delta_max_fraction",  # the publisher's
    # ring and catch-up server
    "weightsync.every_steps",  # how often the learner publishes: generators follow the announcements
)
"""Keys of SHARED_SECTIONS that only the learner (and the launcher that starts it) reads. They are left out of the
shared hash and of the shared config a refused generator is shown, so a generator need not repeat them (it used to
be refused for not repeating buffer.done_grace_s). A key added to a shared section that generators do not read
belongs here; `tests/unit/test_config.py` checks each one still names a key."""


MOVED_KEYS = {
    **{f"buffer.redis_{key}": f"buffer.redis.{key}" for key in ("url", "tls_ca_file", "tls_cert_file", "tls_key_file",
                                                                "namespace", "reconnect_s", "appendfsync")},
    "buffer.lease_s": "buffer.redis.lease_s",
    "buffer.reclaim_idle_s": "buffer.redis.reclaim_idle_s",
    **{f"generator.{key}": f"generator.vllm.{key}" for key in ("tensor_parallel_size", "gpu_memory_utilization",
                                                               "enforce_eager", "enable_prefix_caching")},
    "learner.publish_bucket_mb": "learner.gather_bucket_mb",
    "weightsync.catchup_host": "weightsync.host",
    "weightsync.catchup_advertise": "weightsync.advertise",
}
"""Old key -> its new name: backend knobs moved under their backend, and names that now say what they are.
Recipes and overrides written before the move still load, with a
FutureWarning (shown by default, unlike DeprecationWarning) that names the new key."""


class ConfigError(ValueError):
    """A recipe or override is wrong; the message names the key."""


def warn_moved(old: str) -> str:
    """The new name of a moved key, after a warning that names it."""
    new = MOVED_KEYS[old]
    warnings.warn(f"config key {old} is deprecated: it is now {new}", FutureWarning, stacklevel=4)
    return new


def move_flat_keys(tree: dict) -> dict:
    """A recipe's tree with every old key (MOVED_KEYS) moved to its new place, each with a warning."""
    for old in MOVED_KEYS:
        section, key = old.split(".")
        if not (isinstance(tree.get(section), dict) and key in tree[section]):
            continue
        value = tree[section].pop(key)
        new = warn_moved(old)
        *path, leaf = new.split(".")
        node = tree
        for depth, part in enumerate(path):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"config key {'.'.join(path[:depth + 1])} must be a mapping, got {node!r}")
        if leaf in node:
            raise ConfigError(f"config keys {old} and {new} are both set; {old} is the old name of {new}: keep one")
        node[leaf] = value
    return tree


def move_flat_override(item: str) -> str:
    """`buffer.redis_url=x` -> `buffer.redis.url=x` (with a warning); other overrides are returned as they are."""
    key, _, value = item.partition("=")
    return f"{warn_moved(key.strip())}={value}" if key.strip() in MOVED_KEYS else item


@dataclass
class RunConfig:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    demo: DemoConfig = field(default_factory=DemoConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    tools: ToolsConfig = field(default_factory=ToolsConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    generator: GeneratorConfig = field(default_factory=GeneratorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    prm: PRMConfig = field(default_factory=PRMConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    weightsync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward_server: RewardServerConfig = field(default_factory=RewardServerConfig)

    def __post_init__(self):
        check_sections_agree(self)

    def samples_episodes(self) -> bool:
        """Whether samples are multi-turn episodes: tools, an environment or an agent answers the model."""
        return bool(self.tools.offered() or self.env.path or self.agent.path)


def check_episodes(cfg: "RunConfig") -> None:
    """Tools, an environment or an agent make episodes multi-turn; each needs the others' absence and a turn budget."""
    chosen = [name for name, on in (("tools", cfg.tools.offered()), ("env.path", bool(cfg.env.path)),
                                    ("agent.path", bool(cfg.agent.path))) if on]
    if len(chosen) > 1:
        unset = " ".join(f"tools.{key}=[]" for key in ("functions", "builtins", "mcp_servers")
                         if getattr(cfg.tools, key))
        hint = f"; to drop a recipe's tools, add {unset}" if "tools" in chosen else ""
        raise ValueError(f"{' and '.join(chosen)} are both set: episodes come from one of them (the tool "
                         f"environment is one environment; call tools from your own environment or agent){hint}")
    if cfg.tools.offered() and cfg.rollout.max_turns < 2:
        raise ValueError("tools are set but rollout.max_turns < 2: the model could call a tool but never "
                         "read its result; set rollout.max_turns >= 2")
    if cfg.rollout.max_turns > 1 and not chosen:
        raise ValueError(f"rollout.max_turns={cfg.rollout.max_turns} but nothing answers the model between turns: "
                         f"set tools.functions, tools.builtins, env.path or agent.path")
    problem = cfg.algo.per_turn_problem()
    if chosen and problem and cfg.rollout.turn_samples == "per_turn":
        raise ValueError(f"rollout.turn_samples=per_turn trains each model turn with its episode's advantage, but "
                         f"{problem}; use algo.advantage=grpo or rloo, or rollout.turn_samples=episode")
    if problem and cfg.rollout.turn_samples == "auto":
        cfg.rollout.turn_samples = "episode"  # auto may only choose what the algorithm can train
    if chosen and cfg.rollout.greedy_baseline:
        raise ValueError("ReMax's greedy baseline (algo.advantage=remax) is single-turn only; use grpo or rloo "
                         "with tools or an environment")


def check_sections_agree(cfg: "RunConfig") -> None:
    """Rules that span sections. ReMax's greedy baseline is switched on for the generators rather than
    rejected, because asking for remax already says that the baseline is wanted."""
    if cfg.algo.needs_greedy_baseline():
        cfg.rollout.greedy_baseline = True
    check_episodes(cfg)
    if not cfg.algo.needs_critic() and cfg.critic != CriticConfig():
        raise ValueError(f"the critic section is set, but algo.advantage={cfg.algo.advantage} with algo.correction="
                         f"{cfg.algo.correction} has no value model (use algo.advantage=gae, or vtrace with "
                         f"algo.vtrace_values=critic)")
    if not cfg.algo.needs_prm() and cfg.prm != PRMConfig():
        raise ValueError(f"the prm section is set, but algo.advantage={cfg.algo.advantage} reads no process reward "
                         f"model (use algo.advantage=prime; configs/prime.yaml)")
    if cfg.algo.needs_critic() and cfg.critic.warmup_steps >= cfg.learner.total_steps:
        raise ValueError(f"critic.warmup_steps={cfg.critic.warmup_steps} leaves no step of learner.total_steps="
                         f"{cfg.learner.total_steps} to train the policy")
    if cfg.rollout.n < 2:
        if cfg.algo.advantage in GROUP_ADVANTAGES:
            raise ValueError(f"algo.advantage={cfg.algo.advantage} takes its baseline from the other samples of "
                             f"the group, so rollout.n must be >= 2 (got {cfg.rollout.n})")
        if cfg.algo.dynamic_sampling:
            raise ValueError("algo.dynamic_sampling drops groups whose rewards are all equal, which is every "
                             "group when rollout.n = 1; set rollout.n >= 2")
    lead, lead_key = cfg.buffer.lead_steps, ("buffer.max_staleness" if cfg.buffer.admission_lead is None
                                             else "buffer.admission_lead")
    if cfg.weightsync.every_steps > lead + 1:
        raise ValueError(
            f"weightsync.every_steps={cfg.weightsync.every_steps} with {lead_key}={lead}: "
            f"admission stays at the last published version, so after {lead + 1} unpublished steps "
            f"no generator may start a group and the learner would wait for a batch forever; use every_steps <= "
            f"{lead_key.split('.')[1]} + 1 (or raise {lead_key})")
    if cfg.weightsync.backend == "engine_push" and cfg.generator.engine not in ("vllm", "sglang"):
        raise ValueError(f"weightsync.backend=engine_push pushes into vLLM's or SGLang's weight-update calls; "
                         f"generator.engine={cfg.generator.engine} has none (use shm or broadcast)")
    if (cfg.weightsync.backend == "engine_push" and cfg.weightsync.engine_transport == "ipc"
            and cfg.generator.engine != "vllm"):
        raise ValueError("weightsync.engine_transport=ipc is vLLM's IPC transfer engine; use nccl with "
                         f"generator.engine={cfg.generator.engine}")
    if cfg.learner.lora.enabled:
        check_lora(cfg)
    if cfg.learner.moe_routing_replay:
        check_routing_replay(cfg)
    if cfg.learner.liger and (cfg.rollout.top_k > 0 or cfg.rollout.top_p < 1 or cfg.algo.entropy_coef > 0):
        raise ValueError("learner.liger computes the full softmax's logprobs without their logits: it cannot follow "
                         "rollout.top_k / rollout.top_p sampling nor give algo.entropy_coef's gradient")
    if cfg.reward.overlong_buffer_len >= cfg.rollout.max_tokens:
        raise ValueError(f"reward.overlong_buffer_len ({cfg.reward.overlong_buffer_len}) must be smaller than "
                         f"rollout.max_tokens ({cfg.rollout.max_tokens})")


def check_routing_replay(cfg: "RunConfig") -> None:
    """Routing replay (moe/routing.py) needs every sampled token's route, position by position, in the learner's
    padded rows: each sample is one model turn (an episode's environment tokens were routed by no sampler), the
    rows are neither packed nor split over ranks, and the engine records routes (hf here; vLLM's capture needs its
    Model Runner V2, which needs Triton: GPU only)."""
    if cfg.samples_episodes():
        raise ValueError("learner.moe_routing_replay replays the routes of single-turn samples; episodes with tools, "
                         "an environment or an agent are not supported")
    if cfg.learner.packing or cfg.learner.sp_size > 1:
        raise ValueError("learner.moe_routing_replay needs padded micro-batches on one rank per sequence: turn off "
                         "learner.packing and keep learner.sp_size=1")
    if cfg.generator.engine not in ("hf", "vllm"):
        raise ValueError(f"learner.moe_routing_replay needs an engine that records routes (hf, or vllm on a GPU); "
                         f"generator.engine={cfg.generator.engine} does not")


def check_lora(cfg: "RunConfig") -> None:
    """LoRA versions are adapters the generators' engines load as such (generator/engines/lora_adapter.py): the
    vLLM and hf engines do; SGLang's path and the pushed-weights backend move full weights only."""
    if cfg.generator.engine == "sglang":
        raise ValueError("learner.lora serves each version as an adapter, which asyncrl does for generator.engine="
                         "vllm and hf; SGLang's adapter path is not built (use vllm, or learner.lora.rank=0)")
    if cfg.weightsync.backend == "engine_push":
        raise ValueError("learner.lora publishes only the adapter, and weightsync.backend=engine_push pushes full "
                         "weights into the engine; use weightsync.backend=shm or broadcast")


def training_eval_blocker(cfg: "RunConfig") -> Optional[str]:
    """Why evaluation during training (eval.every_steps, eval.before_train) cannot run in this job, or None. It is
    dealt by the learner to generators that load the version they are asked for (buffer/eval_rounds.py). The
    learner says so at start and trains without it: a recipe's evaluation (the demo's) must not stop a job run
    with tools or engine_push."""
    if cfg.weightsync.backend == "engine_push":
        return "it needs a staged weightsync.backend (shm or broadcast): a pushed engine cannot hold an older version"
    if cfg.samples_episodes():
        return "it samples single-turn completions, and this job's prompts are episodes"
    return None


def to_yaml(cfg: RunConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: RunConfig) -> dict:
    return asdict(cfg)


def shared_sections(cfg: RunConfig) -> dict:
    """The sections every process of a job must agree on (SHARED_SECTIONS), as JSON-able dicts, and job.seed: it
    seeds the held-out split (data.val_fraction) and every part whose own seed is unset, so a generator started with
    another one would sample another job's streams. The rest of the job section (its name, its out_dir) may differ
    between machines, and so may LEARNER_ONLY_KEYS."""
    shared = {"job": {"seed": cfg.job.seed}, **{name: asdict(getattr(cfg, name)) for name in SHARED_SECTIONS}}
    for path in LEARNER_ONLY_KEYS:
        *parents, leaf = path.split(".")
        node = shared
        for part in parents:
            node = node[part]
        del node[leaf]
    return shared


def shared_hash(cfg: RunConfig) -> str:
    """Hash of the sections every process of a job must agree on (see SHARED_SECTIONS)."""
    return hashlib.sha256(json.dumps(shared_sections(cfg), sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(mine: dict, theirs: dict, limit: int = 8) -> str:
    """`section.key (this process X, the learner Y)` for each shared setting that differs, in one line."""
    differing = []
    for section in sorted(set(mine) | set(theirs), key=str):
        ours, other = mine.get(section), theirs.get(section)
        ours, other = ours if isinstance(ours, dict) else {}, other if isinstance(other, dict) else {}
        for key in sorted(set(ours) | set(other), key=str):
            if ours.get(key, "<unset>") != other.get(key, "<unset>"):
                differing.append(f"{section}.{key} (this generator {repr(ours.get(key, '<unset>'))[:80]}, the "
                                 f"learner {repr(other.get(key, '<unset>'))[:80]})")
    if not differing:
        return "the shared sections hash differently but no key differs (another asyncrl version?)"
    more = f", and {len(differing) - limit} more" if len(differing) > limit else ""
    return "; ".join(differing[:limit]) + more


def flatten(cfg: RunConfig) -> dict:
    """`section.key -> str(value)`, for MLflow params (a nested section, such as buffer.redis, is one param)."""
    out = {}
    for section, values in asdict(cfg).items():
        for key, value in values.items():
            out[f"{section}.{key}"] = str(value)
    return out
