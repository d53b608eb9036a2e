"""Config sections that belong to no single part: the job, the model, the reward, evaluation and the demo."""
import math
import re
from dataclasses import dataclass, field
from typing import List, Optional

DEMO_TASKS = ("", "sort_digits", "add_numbers", "add_subtract", "square_colour")
DEMO_SHAPES = ("tiny", "qwen2-0.5b")


@dataclass
class JobConfig:
    name: str = "asyncrl"
    """Job name, used for the MLflow run name and the job directory."""
    out_dir: str = "runs"
    """Parent of the job directory (logs, progress, summary, config)."""
    seed: int = 0
    """Global seed: every part seed left unset (learner.seed, generator.seed, sft.seed, data.seed) is this one, so
    changing it alone changes the whole job (data order, the held-out split, initialisation, sampling)."""

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ValueError(f"job.name must be a non-empty name without '/', got {self.name!r}")


def part_seed(seed: Optional[int], job_seed: int) -> int:
    """A part's seed: its own when set (an explicit value wins), else job.seed itself. Not an offset of job.seed:
    the parts draw from different generators anyway (the learner's torch RNG, each generator's sampler, which
    generator/main.py::sampling_seed already offsets by the generator's id, the dealer's shuffle), and job.seed=0
    keeps giving the numbers measured when these seeds defaulted to 0."""
    return job_seed if seed is None else seed


@dataclass
class ModelConfig:
    path: Optional[str] = None
    """Local HF model directory (config, safetensors, tokenizer). None with demo.task set: the demo model."""
    trust_remote_code: bool = False
    """Passed to transformers and vLLM; off unless you trust the model directory."""
    lm_head_fp32: bool = False
    """Compute the LM head (the last matmul, hidden -> logits) in fp32 on the learner and in vLLM
    (`hf_overrides={"head_dtype": "float32"}`), so bf16 weights do not round the logits the two sides compare;
    what RL training-inference consistency asks for with bf16 models. Costs one fp32 matmul per chunk of positions."""


@dataclass
class RewardFunction:
    """One named, weighted component of the reward (reward.functions)."""

    name: str = ""
    """Logged as `reward/<name>/mean`; letters, digits, `_`, `-` and `.`."""
    weight: float = 1.0
    """The reward is the weighted sum of the components."""
    path: Optional[str] = None
    """Python file with the function; None: the built-in scorer of the row's data_source."""
    function: str = "compute_score"
    """Name of the function in `path` (verl's signature)."""
    server: Optional[str] = None
    """URL of a reward server (`asyncrl reward-server`: a reward model or an LLM judge), e.g.
    http://127.0.0.1:8700; it scores the prompt and the completion. Instead of `path`."""

    def __post_init__(self):
        if not self.name or not all(c.isalnum() or c in "_-." for c in self.name):
            raise ValueError(f"reward.functions: each needs a name of letters, digits, '_', '-' or '.', got "
                             f"{self.name!r}")
        if self.server is not None and (self.path is not None or not self.server.startswith(("http://",
                                                                                             "https://"))):
            raise ValueError(f"reward.functions[{self.name}].server must be an http(s):// URL, and without a path; "
                             f"got server={self.server!r}, path={self.path!r}")
        if not math.isfinite(self.weight):
            raise ValueError(f"reward.functions[{self.name}].weight must be finite, got {self.weight}")


@dataclass
class RewardConfig:
    path: Optional[str] = None
    """Python file with the reward function; None uses the built-in reward of the row's data_source."""
    function: str = "compute_score"
    """Name of the function in `path`: compute_score(data_source, solution_str, ground_truth, extra_info=None)."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: completions longer than rollout.max_tokens - this many tokens are penalised
    linearly, down to -overlong_penalty_factor at max_tokens. 0 turns shaping off."""
    overlong_penalty_factor: float = 1.0
    """DAPO overlong shaping: the penalty at (and beyond) rollout.max_tokens, in reward units."""
    timeout_s: float = 30.0
    """Longest one reward call may take, in seconds; past it the worker is killed, the sample scores 0, and
    `generator/reward_errors/timeout` counts it."""
    functions: List[RewardFunction] = field(default_factory=list)
    """Several reward functions, each with a name and a weight: the reward is their weighted sum, each component is
    logged (`reward/<name>/mean`), and all of them run in one call per sample (one timeout for the whole). Empty:
    `path` and `function` (or the built-in scorer) alone. A component that fails fails the sample (it scores 0,
    counted), since the sum would be wrong without it."""

    def __post_init__(self):
        names = [f.name for f in self.functions]
        if len(set(names)) != len(names):
            raise ValueError(f"reward.functions: names must be unique, got {names}")
        if self.functions and self.path is not None:
            raise ValueError("set reward.functions or reward.path, not both (put the reward.path function in "
                             "reward.functions with a name and a weight)")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s must be > 0, got {self.timeout_s}")
        if self.overlong_buffer_len < 0:
            raise ValueError(f"reward.overlong_buffer_len must be >= 0, got {self.overlong_buffer_len}")
        if self.overlong_penalty_factor < 0:
            raise ValueError(f"reward.overlong_penalty_factor must be >= 0, got {self.overlong_penalty_factor}")


SERVER_KINDS = ("classifier", "judge")


@dataclass
class RewardServerConfig:
    """`asyncrl reward-server`: a reward model served to the generators (generator/reward_server/)."""

    kind: str = "classifier"
    """`classifier`: an HF sequence-classification model (one label), its logit the score, batched across
    requests. `judge`: an LLM run by the generators' engine code, asked `template` and scored by `score_pattern`."""
    model_path: Optional[str] = None
    """The reward model or judge (a local directory)."""
    host: str = "127.0.0.1"
    """Address the server binds to; 0.0.0.0 serves generators on other hosts (reward.functions[].server names its URL)."""
    port: int = 8700
    """TCP port the server listens on."""
    max_batch: int = 32
    """Most items scored in one forward pass (classifier) or sampled at once (judge)."""
    batch_wait_s: float = 0.005
    """How long the first item of a batch waits for others to join it, in s."""
    max_queue: int = 1024
    """Items waiting at most; past it a request is refused with 503 and Retry-After (back-pressure, not memory)."""
    request_timeout_s: float = 30.0
    """A request not scored within this long, in s, is answered 504."""
    max_length: int = 2048
    """classifier: tokens of prompt + response scored (the start is cut: the response's end matters most)."""
    engine: str = "hf"
    """judge: the engine (`hf` or `vllm`), as a generator's."""
    dtype: str = "float32"
    """Dtype the model is loaded in: float32, bfloat16 or float16."""
    template: str = ("Question: {prompt}\nAnswer: {response}\nReference answer: {ground_truth}\n"
                     "Rate the answer from 0 to 10. Score:")
    """judge: the user message the judge answers; {prompt}, {response}, {ground_truth} and {data_source} are filled
    in (the prompt is the row's last user message)."""
    score_pattern: str = r"(-?\d+(?:\.\d+)?)"
    """judge: a regular expression; the first match's first group, times `score_scale`, is the score."""
    score_scale: float = 0.1
    """judge: the factor from the parsed number to the reward (0.1 maps a 0-10 rating to 0-1)."""
    unparsed_score: float = 0.0
    """judge: the score of a verdict the pattern does not match (counted under judge/unparsed)."""
    max_tokens: int = 16
    """judge: tokens of the verdict."""
    temperature: float = 0.0
    """judge: 0 is greedy."""
    max_model_len: int = 4096
    """judge: the longest prompt plus verdict the judge's engine accepts, in tokens."""
    kv_cache_gib: float = 0.5
    """judge on vLLM (CPU): the KV cache's size, as generator.kv_cache_gib."""

    def __post_init__(self):
        if self.kind not in SERVER_KINDS:
            raise ValueError(f"reward_server.kind must be one of {SERVER_KINDS}, got {self.kind!r}")
        for key in ("max_batch", "max_queue", "max_length", "max_tokens", "max_model_len"):
            if getattr(self, key) < 1:
                raise ValueError(f"reward_server.{key} must be >= 1, got {getattr(self, key)}")
        if not (self.request_timeout_s > 0 and self.batch_wait_s >= 0):
            raise ValueError("reward_server.request_timeout_s must be > 0 and batch_wait_s >= 0")
        if not 0 <= self.port < 65536:
            raise ValueError(f"reward_server.port must be a port number, got {self.port}")
        try:
            compiled = re.compile(self.score_pattern)
        except re.error as err:
            raise ValueError(f"reward_server.score_pattern is not a regular expression: {err}") from None
        if compiled.groups < 1:
            raise ValueError("reward_server.score_pattern needs a group around the number, e.g. (\\d+)")


@dataclass
class EvalConfig:
    """Evaluation on held-out prompts: during training on the generator fleet (buffer/eval_rounds.py), and offline
    (`asyncrl eval`, generator/evaluation.py)."""

    files: List[str] = field(default_factory=list)
    """Parquet files in verl's row format (several data sources welcome: metrics are per data_source). The demo
    (demo.task) evaluates on its held-out split when this is empty."""
    every_steps: int = 0
    """Evaluate the weights of every this many versions on the generator fleet while training goes on, logged
    under eval/<data_source>/... at that step; 0: never during training."""
    before_train: bool = False
    """Also evaluate version 0 (the starting weights)."""
    timeout_s: float = 600.0
    """An evaluation round not finished within this long is abandoned (eval/rounds_abandoned), in s; the job's
    end waits at most this long for the last one."""
    n: int = 1
    """Samples per prompt."""
    temperature: float = 0.0
    """0: greedy."""
    max_tokens: int = 0
    """Completion length cap; 0: rollout.max_tokens."""
    k_values: List[int] = field(default_factory=lambda: [1])
    """pass@k for each k (<= n), with the unbiased estimator."""
    pass_threshold: float = 1.0
    """A sample passes when its reward is at least this (1.0: the built-in scorers' "right")."""

    def __post_init__(self):
        if self.n < 1:
            raise ValueError(f"eval.n must be >= 1, got {self.n}")
        if self.temperature < 0 or self.max_tokens < 0 or self.every_steps < 0:
            raise ValueError("eval.temperature, eval.max_tokens and eval.every_steps must be >= 0")
        if not self.timeout_s > 0:
            raise ValueError(f"eval.timeout_s must be > 0, got {self.timeout_s}")
        bad = [k for k in self.k_values if not 1 <= k <= self.n]
        if bad:
            raise ValueError(f"eval.k_values must lie in [1, eval.n={self.n}], got {bad}")


@dataclass
class DemoConfig:
    task: str = ""
    """Built-in demo task whose tokenizer, model, dataset and SFT warm start are built and cached; '' = off. Off
    too, whatever it says, in a job that brings its own model or data (model.path, data.train_files or a
    data.source other than files): such a job never builds or evaluates on the demo's assets (`demo_active`)."""
    cache_dir: str = "~/.cache/asyncrl/demo"
    """Where demo assets are cached; they are rebuilt only when their settings change."""
    num_prompts: int = 4096
    """Training prompts generated for the demo dataset."""
    hidden_size: int = 128
    """Demo model width."""
    num_layers: int = 4
    """Demo model depth."""
    model_shape: str = "tiny"
    """"tiny": a Qwen2 of demo.hidden_size x demo.num_layers (the CPU demo). "qwen2-0.5b": Qwen2-0.5B's published
    body (24 layers, 896 wide, 14 query and 2 KV heads of 64, 4864 MLP, rope theta 1e6, tied embeddings), randomly
    initialised, for GPU checks (scripts/test_gpu); its vocabulary is the task's tokenizer's, not Qwen's 151936,
    whose ids a locally trained tokenizer could not decode."""
    sft_steps: int = 60
    """Steps of the SFT warm start (steps, not seconds, so every machine starts from the same point)."""
    sft_lr: float = 1e-3
    """Learning rate of the SFT warm start."""
    sft_batch_size: int = 128
    """Sequences per SFT step."""

    def __post_init__(self):
        if self.task not in DEMO_TASKS:
            raise ValueError(f"demo.task must be one of {DEMO_TASKS}, got {self.task!r}")
        if self.model_shape not in DEMO_SHAPES:
            raise ValueError(f"demo.model_shape must be one of {DEMO_SHAPES}, got {self.model_shape!r}")
        if self.num_prompts < 1 or self.sft_steps < 0 or self.sft_batch_size < 1:
            raise ValueError("demo.num_prompts and demo.sft_batch_size must be >= 1 and demo.sft_steps >= 0")


def own_inputs(model, data) -> list:
    """The keys by which a job brings its own model or data (`model`, `data`: those sections): model.path,
    data.train_files, a data.source other than files."""
    keys = ["model.path"] if model.path is not None else []
    if data.train_files:
        keys.append("data.train_files")
    if data.source != "files":
        keys.append(f"data.source={data.source}")
    return keys


def demo_active(demo, model, data) -> bool:
    """Whether this job runs the demo (its assets, its prompts, its held-out evaluation): demo.task is set and the
    job brings neither a model nor data of its own. The one place that answers it, because the default recipe
    sets demo.task: a user who gives model.path and data.train_files on top of it must not get the demo's prompts
    or, worse, an evaluation of their model on the demo's held-out split logged as if it were theirs."""
    return bool(demo.task) and not own_inputs(model, data)


def demo_off_note(demo, model, data) -> Optional[str]:
    """The line said once at start when the recipe's demo.task is ignored (None when it is not)."""
    keys = own_inputs(model, data)
    if not demo.task or not keys:
        return None
    return f"demo.task={demo.task} is off: this job brings its own model/data ({', '.join(keys)})"
