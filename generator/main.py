"""The generator process, as build, run, close: connect to the learner and get the job's run info, build the
rollout loop and what it uses (model files, tokenizer, prompts, reward, weight staging, engine, episodes, metrics;
`build_rollout`), load the newest weights before sampling anything, run the rollout loop until the learner says
the job is done (buffer/done.py), then close what was built, in reverse order. `run_generator` maps the errors a
restart would not fix to a message and exit code 1."""
import asyncio
import contextlib
import hashlib
import logging
import os

from asyncrl.buffer.backends import make_generator_buffer
from asyncrl.buffer.done import BYE_TIMEOUT_S
from asyncrl.buffer.interface import GeneratorBuffer, GeneratorRefused, HelloReply, LearnerUnavailable
from asyncrl.configs import describe_difference, shared_hash, shared_sections
from asyncrl.configs.sections import part_seed
from asyncrl.generator.agents.build import build_episode_runner, wants_episodes
from asyncrl.generator.agents.chat_render import TemplateCannotAppend
from asyncrl.generator.agents.environment import EnvironmentLoadError
from asyncrl.generator.agents.mcp_tools import McpServerError
from asyncrl.generator.agents.openai_agent import AgentLoadError
from asyncrl.generator.agents.tools import ToolLoadError
from asyncrl.data.prompts import iterate_prompts, job_rows, tokenize_rows
from asyncrl.generator.event_loop import run as run_event_loop
from asyncrl.generator.engines.base import EngineBroken, EngineUnsupported
from asyncrl.generator.engines.factory import engine_options, make_engine
from asyncrl.generator.rewards.client import wait_for_server
from asyncrl.generator.rewards.errors import RewardError
from asyncrl.generator.rewards.functions import check_builtin_rewards, uses_builtin_rewards
from asyncrl.generator.model_source import resolve_model
from asyncrl.generator.rollout import RolloutLoop
from asyncrl.generator.run_metrics import GeneratorRunMetrics
from asyncrl.generator.rewards.scorer import RewardScorer
from asyncrl.security.curve import KeysError, client_keys
from asyncrl.weightsync.catchup import CatchupError
from asyncrl.weightsync.model_files import ModelFilesError
from asyncrl.weightsync.receiver import WeightStage

log = logging.getLogger(__name__)
HELLO_TIMEOUT_S = 2.0
"""Each hello waits this long for an answer; they repeat until generator.connect_timeout_s."""


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
    """Build the generator's pieces, run the rollout loop until the learner says the job is done, close.

    What was built is closed in reverse order of building, also when a step fails part-way; before that the
    learner is told this generator leaves (unless it said the job is done: it has stopped listening)."""
    generator_id = cfg.generator.generator_id or f"gen-{os.getpid()}"
    built = contextlib.AsyncExitStack()
    client = make_generator_buffer(cfg.buffer, cfg.security, cfg.job.name, generator_id)
    built.callback(client.close)  # closed last
    rollout = None
    try:
        hello = await join_learner(client, cfg, say)
        if not hello.done:
            rollout = await build_rollout(cfg, client, hello, generator_id, built, say)
            # starting the engine takes a while, and the learner may have finished the job (and stopped serving
            # its weights) meanwhile: ask again before loading, so a generator that came too late stops cleanly
            # (with the same patience as the first: a learner that is resuming may take seconds to answer)
            hello = await wait_for_learner(client, shared_hash(cfg), cfg.generator.connect_timeout_s, say)
            rollout.note_reply(hello)
        if hello.done:
            say(f"generator {generator_id}: the learner at {client.endpoint} has finished the job; nothing to do")
            return 0
        await rollout.weights.ensure_latest()  # a late joiner samples nothing before it has the current weights
        say(f"generator {generator_id}: {cfg.generator.engine} engine ready on v{rollout.engine.version}")
        await rollout.run()
        return 0
    except LearnerUnavailable:
        if rollout is not None and rollout.done:
            return 0  # the learner finished and went away while our last groups were in flight
        raise
    finally:
        if rollout is None or not rollout.done:  # after "done" the learner has stopped listening
            await say_bye(client, generator_id)
        await built.aclose()


async def say_bye(client: GeneratorBuffer, generator_id: str) -> None:
    try:
        await client.bye(timeout_s=BYE_TIMEOUT_S)
    except Exception as err:  # best effort: the learner reclaims our admissions when we fall silent
        log.debug("generator %s: bye was not answered (%s)", generator_id, err)


async def build_rollout(cfg, client, hello: HelloReply, generator_id: str, built: contextlib.AsyncExitStack,
                        say) -> RolloutLoop:
    """The rollout loop and what it uses, in the order they start; each is registered in `built` to be closed."""
    info = hello.run_info
    seed = sampling_seed(part_seed(cfg.generator.seed, cfg.job.seed), generator_id)
    if cfg.generator.torch_threads:
        import torch

        torch.set_num_threads(cfg.generator.torch_threads)
    from transformers import AutoTokenizer

    keys = client_keys(cfg.security.keys_dir, cfg.security.client_name)
    model_path = await resolve_model(cfg.generator, cfg.weightsync.timeout_s, client, hello, shared_hash(cfg),
                                     generator_id, keys, say)
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    prompts, data_sources = None, info.data_sources
    if not info.deals:  # a learner that deals no prompts: walk a copy of the dataset
        prompts, data_sources = local_prompts(cfg.data, cfg.job.seed, list(info.train_files), tokenizer, seed,
                                              generator_id)
    scorer = await start_scorer(cfg.reward, cfg.generator, data_sources, generator_id, built, say)
    stage = WeightStage(cfg.weightsync.shm_dir, generator_id, cfg.weightsync.timeout_s, keys=keys)
    built.callback(stage.close)
    ipc_push = cfg.weightsync.backend == "engine_push" and cfg.weightsync.engine_transport == "ipc"
    engine = make_engine(cfg.generator.engine, engine_options(
        cfg.generator, cfg.model, model_path, seed, info.lora_rank, cfg.buffer.max_staleness, ipc_push,
        record_routes=info.routing_replay, takes_versions=True, max_images=cfg.data.max_images))
    built.push_async_callback(engine.close)
    await engine.start()
    episodes = None
    if wants_episodes(cfg.tools, cfg.env, cfg.agent):
        episodes = build_episode_runner(cfg.tools, cfg.env, cfg.agent, cfg.rollout,
                                        max_model_len=cfg.generator.max_model_len,
                                        max_prompt_tokens=cfg.data.max_prompt_tokens,
                                        tool_workers=cfg.generator.tool_workers, engine=engine, tokenizer=tokenizer)
        built.push_async_callback(episodes.close)
        await episodes.start()
    run_metrics = GeneratorRunMetrics(generator_id, cfg.telemetry.system_metrics_every_s)
    built.callback(run_metrics.close)
    run_metrics.follow(info)

    async def rejoin() -> HelloReply:
        """The learner stopped answering mid-job: wait for it as at start; a resumed learner names its own run."""
        reply = await wait_for_learner(client, shared_hash(cfg), cfg.generator.connect_timeout_s, say)
        run_metrics.follow(reply.run_info)
        return reply

    return RolloutLoop(
        client, engine, prompts, scorer, tokenizer, cfg.rollout, cfg.generator.max_inflight_groups, generator_id,
        reward_shaping=cfg.reward, on_stats=lambda metrics: run_metrics.log(metrics, step=engine.version),
        stats_every_s=cfg.generator.log_every_s, stage=stage, drop_zero_variance=cfg.algo.dynamic_sampling,
        episodes=episodes, rejoin=rejoin)


async def start_scorer(reward, gen, data_sources, generator_id: str, built: contextlib.AsyncExitStack,
                       say) -> RewardScorer:
    """The job's reward, its workers importing the reward function while the engine starts; a reward server it
    names may start after the generators, so it is waited for."""
    if uses_builtin_rewards(reward):
        check_builtin_rewards(set(data_sources or ()))
    scorer = RewardScorer(reward.path, reward.function, gen.reward_workers, reward.timeout_s,
                          source=f"generator {generator_id}", functions=reward.functions)
    built.push_async_callback(scorer.close)
    await scorer.start()
    for url in scorer.servers:
        await wait_for_server(url, gen.connect_timeout_s, say)
    return scorer


def local_prompts(data, job_seed: int, train_files: list, tokenizer, seed: int, generator_id: str):
    """This generator's own endless walk over the dataset, when the learner deals no prompts, and the data sources
    in it: the rows trained on (job_rows leaves data.val_fraction's held-out rows out, as the learner's dealer
    does). Shuffled with this generator's seed: not exactly once across the fleet."""
    rows, skipped = tokenize_rows(job_rows(data, job_seed, train_files), tokenizer, data.max_prompt_tokens)
    if skipped:
        log.warning("generator %s: skipped %d prompts longer than data.max_prompt_tokens", generator_id, skipped)
    return iterate_prompts(rows, data.shuffle, seed), sorted({row.data_source for row in rows})


def run_generator(cfg, say=print) -> int:
    try:
        return run_event_loop(run_generator_async(cfg, say), cfg.generator.event_loop)
    except EngineBroken as err:  # the engine holds weights nobody vouches for: only a fresh process can serve
        say(f"generator stopped: {err}; restart it (it joins on the current weights)")
        return 1
    except EngineUnsupported as err:  # refused before it sampled anything: a restart is refused alike
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
