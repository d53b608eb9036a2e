"""The generator process: connect to the learner, get the job's run info, start the engine, load the newest
weights before sampling anything, then run the rollout loop until the learner says the job is done
(buffer/done.py)."""
import asyncio
import hashlib
import logging
import os
import socket

from asyncrl.buffer.backends import make_generator_buffer
from asyncrl.buffer.done import BYE_TIMEOUT_S
from asyncrl.buffer.interface import GeneratorBuffer, GeneratorRefused, HelloReply, LearnerUnavailable, RunInfo
from asyncrl.configs import describe_difference, shared_hash, shared_sections
from asyncrl.generator.agents.build import build_episode_runner, wants_episodes
from asyncrl.generator.agents.chat_render import TemplateCannotAppend
from asyncrl.generator.agents.environment import EnvironmentLoadError
from asyncrl.generator.agents.mcp_tools import McpServerError
from asyncrl.generator.agents.openai_agent import AgentLoadError
from asyncrl.generator.agents.tools import ToolLoadError
from asyncrl.generator.dataset import iterate_prompts, job_rows, tokenize_rows
from asyncrl.buffer.event_loop import run as run_event_loop
from asyncrl.generator.engines.base import EngineBroken, EngineUnsupported, make_engine
from asyncrl.generator.reward_server.client import wait_for_server
from asyncrl.generator.rewards import RewardError, check_builtin_rewards, uses_builtin_rewards
from asyncrl.generator.model_source import resolve_model
from asyncrl.generator.rollout import RolloutLoop
from asyncrl.generator.scoring import RewardScorer
from asyncrl.security.curve import KeysError, client_keys
from asyncrl.telemetry.system_metrics import start_system_metrics, stop_system_metrics
from asyncrl.weightsync.catchup import CatchupError
from asyncrl.weightsync.model_files import ModelFilesError
from asyncrl.weightsync.receiver import WeightStage

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 2.0
"""Each hello waits this long for an answer; they repeat until generator.connect_timeout_s."""


def vllm_placement(gen, model) -> dict:
    """The settings only the vLLM engine takes (generator.tensor_parallel_size, ..., model.lm_head_fp32); none for
    the others."""
    if gen.engine != "vllm":
        return {}
    return {"tensor_parallel_size": gen.tensor_parallel_size, "gpu_memory_utilization": gen.gpu_memory_utilization,
            "enforce_eager": gen.enforce_eager, "enable_prefix_caching": gen.enable_prefix_caching,
            "lm_head_fp32": model.lm_head_fp32}


def vllm_lora(gen, lora_rank, max_staleness: int) -> dict:
    """A LoRA learner (its run info's `lora_rank`, learner.lora.rank: the learner's setting, whatever the
    generator's recipe says) publishes adapters, which the vLLM engine serves as such: up to that rank, and every
    version the buffer admits (buffer.max_staleness + 1) at once. The hf engine needs nothing up front."""
    if gen.engine != "vllm" or not lora_rank:
        return {}
    if not isinstance(lora_rank, int) or isinstance(lora_rank, bool) or not 1 <= lora_rank <= 512:
        raise ValueError(f"the learner announced LoRA rank {lora_rank!r}, which is not an integer in [1, 512]")
    return {"lora_rank": lora_rank, "max_loras": max_staleness + 1}


def sampling_seed(base: int, generator_id: str) -> int:
    """The seed of this generator's sampling and prompt order: generator.seed offset by a stable hash of its id, so a
    run whose generators have fixed ids (`asyncrl run` names them gen-0, gen-1, ...) samples the same again, and no
    two generators of a job sample alike."""
    digest = hashlib.sha256(generator_id.encode()).digest()
    return base + int.from_bytes(digest[:4], "little") % 1_000_003


async def wait_for_learner(client: GeneratorBuffer, config_hash: str, timeout_s: float, say) -> HelloReply:
    """Say hello until the learner answers; it may be started after the generator. GeneratorRefused propagates."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    announced = False
    while True:
        try:
            return await client.hello(config_hash, timeout_s=HELLO_TIMEOUT_S)
        except LearnerUnavailable:
            if loop.time() > deadline:
                raise LearnerUnavailable(f"no learner answered at {client.endpoint} within {timeout_s:.0f} s") from None
            if not announced:
                say(f"generator {client.generator_id}: waiting for the learner at {client.endpoint} ...")
                announced = True
            await asyncio.sleep(0.5)  # Redis says "no learner yet" at once; do not spin


async def join_learner(client: GeneratorBuffer, cfg, say) -> HelloReply:
    """wait_for_learner; a config mismatch is refused with the shared keys that differ, in one line."""
    try:
        return await wait_for_learner(client, shared_hash(cfg), cfg.generator.connect_timeout_s, say)
    except GeneratorRefused as err:
        if err.learner_config is None:
            raise
        raise GeneratorRefused(f"config mismatch with the learner at {client.endpoint}: "
                               f"{describe_difference(shared_sections(cfg), err.learner_config)}; start both with the "
                               f"same recipe and shared overrides") from None


async def run_generator_async(cfg, say=print) -> int:
    generator_id = cfg.generator.generator_id or f"gen-{os.getpid()}"
    seed = sampling_seed(cfg.generator.seed, generator_id)
    client = make_generator_buffer(cfg, generator_id)
    engine, metrics_log, rollout, stage, scorer, episodes = None, None, None, None, None, None
    system_metrics = None
    try:
        hello = await join_learner(client, cfg, say)
        if hello.done:
            say(f"generator {generator_id}: the learner at {client.endpoint} has finished the job; nothing to do")
            return 0
        info = hello.run_info
        if cfg.generator.torch_threads:
            import torch

            torch.set_num_threads(cfg.generator.torch_threads)
        from transformers import AutoTokenizer

        keys = client_keys(cfg.security.keys_dir, cfg.security.client_name)
        model_path = await resolve_model(cfg, client, hello, shared_hash(cfg), generator_id, keys, say)
        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
        prompts, data_sources = None, info.data_sources
        if not info.deals:  # a learner that deals no prompts: walk a copy of the dataset
            prompts, data_sources = local_prompts(cfg, info, tokenizer, seed, generator_id)
        if uses_builtin_rewards(cfg.reward):
            check_builtin_rewards(set(data_sources or ()))
        scorer = RewardScorer(cfg.reward.path, cfg.reward.function, cfg.generator.reward_workers,
                              cfg.reward.timeout_s, source=f"generator {generator_id}", functions=cfg.reward.functions)
        await scorer.start()  # the workers import the reward function while the engine starts
        for url in scorer.servers:  # a reward server may start after the generators
            await wait_for_server(url, cfg.generator.connect_timeout_s, say)
        if cfg.weightsync.backend == "engine_push" and cfg.weightsync.engine_transport == "ipc":
            # vLLM's IPC engine decodes the learner's CUDA IPC handles only with this set (they travel pickled
            # through the learner's store, weightsync/engine_push/calls.py); its workers inherit it at start
            os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        engine = make_engine(cfg.generator.engine, model_path=model_path, dtype=cfg.generator.dtype,
                             max_model_len=cfg.generator.max_model_len, kv_cache_gib=cfg.generator.kv_cache_gib,
                             seed=seed, update_mode=cfg.generator.update_mode,
                             trust_remote_code=cfg.model.trust_remote_code,
                             **vllm_placement(cfg.generator, cfg.model),
                             **vllm_lora(cfg.generator, info.lora_rank, cfg.buffer.max_staleness))
        await engine.start()
        if wants_episodes(cfg.tools, cfg.env, cfg.agent):
            episodes = build_episode_runner(cfg.tools, cfg.env, cfg.agent, cfg.rollout,
                                            max_model_len=cfg.generator.max_model_len,
                                            max_prompt_tokens=cfg.data.max_prompt_tokens,
                                            tool_workers=cfg.generator.tool_workers, engine=engine,
                                            tokenizer=tokenizer)
            await episodes.start()
        stage = WeightStage(cfg.weightsync.shm_dir, generator_id, cfg.weightsync.timeout_s, keys=keys)
        metrics_log = _metrics_logger(info, generator_id)
        if metrics_log is not None:
            system_metrics = start_system_metrics(info.tracking_uri, info.mlflow_run_id, generator_id,
                                                  cfg.telemetry.system_metrics_every_s)
        rollout = RolloutLoop(
            client, engine, prompts, scorer, tokenizer, cfg.rollout,
            cfg.generator.max_inflight_groups, generator_id, reward_shaping=cfg.reward,
            on_stats=(lambda m: metrics_log.log(m, step=engine.version)) if metrics_log else None,
            stats_every_s=cfg.generator.log_every_s, stage=stage, drop_zero_variance=cfg.algo.dynamic_sampling,
            episodes=episodes)
        # starting the engine takes a while, and the learner may have finished the job (and stopped serving its
        # weights) meanwhile: ask again before loading, so a generator that came too late stops cleanly
        hello = await client.hello(shared_hash(cfg), timeout_s=HELLO_TIMEOUT_S)
        rollout.note_reply(hello)
        if hello.done:
            say(f"generator {generator_id}: the learner at {client.endpoint} has finished the job; nothing to do")
            return 0
        await rollout.ensure_latest_weights()  # a late joiner samples nothing before it has the current weights
        say(f"generator {generator_id}: {cfg.generator.engine} engine ready on v{engine.version}")
        await rollout.run()
        return 0
    except LearnerUnavailable:
        if rollout is not None and rollout.done:
            return 0  # the learner finished and went away while our last groups were in flight
        raise
    finally:
        if rollout is None or not rollout.done:  # after "done" the learner has stopped listening
            try:
                await client.bye(timeout_s=BYE_TIMEOUT_S)
            except Exception as err:  # best effort: the learner reclaims our admissions when we fall silent
                log.debug("generator %s: bye was not answered (%s)", generator_id, err)
        stop_system_metrics(system_metrics)
        if metrics_log is not None:
            metrics_log.close()
        if engine is not None:
            await engine.close()
        if stage is not None:
            stage.close()
        if scorer is not None:
            await scorer.close()
        if episodes is not None:
            await episodes.close()
        client.close()


def local_prompts(cfg, info: RunInfo, tokenizer, seed: int, generator_id: str):
    """This generator's own endless walk over the dataset, when the learner deals no prompts, and the data sources
    in it. Shuffled with this generator's seed: not exactly once across the fleet."""
    rows, skipped = tokenize_rows(job_rows(cfg.data, cfg.job.seed, list(info.train_files)), tokenizer,
                                  cfg.data.max_prompt_tokens)
    if skipped:
        log.warning("generator %s: skipped %d prompts longer than data.max_prompt_tokens", generator_id, skipped)
    return iterate_prompts(rows, cfg.data.shuffle, seed), sorted({row.data_source for row in rows})


def _metrics_logger(info: RunInfo, generator_id: str):
    """The logger into the learner's run, or None when that cannot work: the learner's store is a file on another
    machine (telemetry.serve is the way), or MLflow does not answer."""
    from asyncrl.telemetry.mlflow_logger import MetricsLogger, is_local_store

    learner_host = info.host
    if is_local_store(info.tracking_uri) and learner_host and learner_host != socket.gethostname():
        log.warning("generator %s: the learner logs to %s, a file on %s; this generator's metrics stay out of the "
                    "run (start the job with telemetry.serve=true, or set telemetry.tracking_uri to a tracking "
                    "server)", generator_id, info.tracking_uri, learner_host)
        return None
    try:
        return MetricsLogger(info.tracking_uri, info.mlflow_run_id, prefix=f"{generator_id}/")
    except Exception as err:  # telemetry must never stop generation
        log.warning("generator %s: MLflow unavailable (%s); metrics go to the learner only", generator_id, err)
        return None


def run_generator(cfg, say=print) -> int:
    try:
        return run_event_loop(run_generator_async(cfg, say), cfg.generator.event_loop)
    except EngineBroken as err:  # the engine holds weights nobody vouches for: only a fresh process can serve
        say(f"generator stopped: {err}; restart it (it joins on the current weights)")
        return 1
    except EngineUnsupported as err:  # refused before any engine was built: a restart is refused alike
        say(f"generator stopped: {err}")
        return 1
    except (RewardError, ToolLoadError, EnvironmentLoadError, TemplateCannotAppend, McpServerError,
            AgentLoadError, KeysError, ModelFilesError, CatchupError) as err:  # the recipe's or the setup's mistake
        say(f"generator stopped: {err}")
        return 1
    except GeneratorRefused as err:  # e.g. started with another recipe than the learner
        say(f"generator refused by the learner: {err}")
        return 1
    except LearnerUnavailable as err:  # the learner never came, or went away before the job was done
        say(f"generator stopped: {err}")
        return 1
