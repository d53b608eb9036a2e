"""Choosing the buffer backend (`buffer.backend`): the learner's `LearnerBuffer` and a generator's `GeneratorBuffer`
(buffer/interface.py). Backends are imported lazily, so a zmq job never imports redis-py and the reverse."""
from asyncrl.buffer.config import BufferConfig, RedisConfig
from asyncrl.buffer.interface import GeneratorBuffer, LearnerBuffer, RunInfo
from asyncrl.buffer.plausibility import JobLimits
from asyncrl.buffer.redis.conn import RedisOptions
from asyncrl.security.config import SecurityConfig


def redis_options(redis: RedisConfig) -> RedisOptions:
    return RedisOptions(url=redis.url, tls_ca_file=redis.tls_ca_file, tls_cert_file=redis.tls_cert_file,
                        tls_key_file=redis.tls_key_file)


def namespace(redis: RedisConfig, job_name: str) -> str:
    """The job's key namespace in Redis: buffer.redis.namespace, else the job's name."""
    return redis.namespace or job_name


def job_limits(rollout, max_prompt_tokens: int, max_positions: int, episodes: bool,
               routing: tuple | None = None, forbidden_tokens: tuple = ()) -> JobLimits:
    """What every group of this job fits: the recipe's sampling (`rollout`, the rollout section's RolloutConfig,
    which lives in generator/ and so is not imported here), its prompt bound
    (data.max_prompt_tokens), the model's positions, whether samples are multi-turn `episodes` (tools, an
    environment or an agent), whose completions may run to the model's positions, and the model's MoE `routing`
    shape (num_layers, top_k, num_experts) when the learner replays routes; `forbidden_tokens`: ids no completion
    holds (a vision-language model's placeholders)."""
    return JobLimits(group_size=rollout.n, temperature=rollout.temperature, top_p=rollout.top_p,
                     top_k=rollout.top_k, max_tokens=rollout.max_tokens,
                     max_completion_tokens=rollout.completion_limit(max_positions, episodes=episodes),
                     max_prompt_tokens=max_prompt_tokens, max_positions=max_positions,
                     max_turns=rollout.max_turns if episodes and rollout.turn_samples != "episode" else 1,
                     episodes=episodes, routing=routing, forbidden_tokens=tuple(forbidden_tokens))


def make_learner_buffer(buffer: BufferConfig, security: SecurityConfig, job_name: str, limits: JobLimits, *,
                        vocab_size: int, config_hash: str, shared_config: dict, run_info: RunInfo, start_version: int,
                        fresh: bool, dealer=None, evals=None) -> LearnerBuffer:
    """The learner's buffer (with its staleness coordinator inside), checking every group against the job's limits.
    With Redis, a fresh start clears what an older run left under the same namespace; a resumed one keeps the
    stream (its unacked groups are still owed training) and moves the version back to the checkpoint's.
    `shared_config` (the learner's shared sections) lets a refused generator say which keys differ. `dealer`
    (buffer/dealing.py) deals the prompts with the admissions (with Redis it holds the rows and the checkpoint's
    cursor, and the cursor lives in Redis: buffer/redis/dealing.py; the server's `dealer` is then that one),
    `evals` (buffer/eval_rounds.py; with Redis through buffer/redis/eval_bridge.py) the evaluation rounds."""
    if buffer.backend == "zmq":
        from asyncrl.buffer.staleness import Coordinator
        from asyncrl.buffer.zmq.server import ZmqBufferServer

        coordinator = Coordinator(buffer.lead_steps, buffer.groups_per_step)
        coordinator.set_version(start_version)
        from asyncrl.security.curve import server_keys

        return ZmqBufferServer(buffer.host, buffer.port, coordinator, vocab_size=vocab_size, config_hash=config_hash,
                               max_message_bytes=buffer.max_message_bytes, queue_groups=buffer.queue_groups,
                               queue_bytes=int(buffer.queue_mb * 2**20), run_info=run_info, limits=limits,
                               shared_config=shared_config, dealer=dealer, evals=evals,
                               keys=server_keys(security.keys_dir))
    from asyncrl.buffer.redis.conn import check_server, configure_durability, connect
    from asyncrl.buffer.redis.coordinator import RedisCoordinator
    from asyncrl.buffer.redis.dealing import RedisDealer
    from asyncrl.buffer.redis.reconnect import Reconnecting
    from asyncrl.buffer.redis.server import RedisBufferServer
    from asyncrl.buffer.redis.stream import reset_job

    redis = buffer.redis
    options = redis_options(redis)
    client = connect(options)
    check_server(client, options.url)  # at startup a wrong URL or setting is an error at once, never retried
    configure_durability(client, options.url, redis.appendfsync)
    job = namespace(redis, job_name)
    if fresh:
        reset_job(client, job)
    retry = Reconnecting(options.url, redis.reconnect_s)
    coordinator = RedisCoordinator(client, job, buffer.lead_steps, buffer.groups_per_step, redis.lease_s,
                                   retry=retry)
    coordinator.set_version(start_version, allow_backwards=True)
    if dealer is not None:  # ready deals for the admissions of the next steps, beyond the staleness window
        dealer = RedisDealer(client, job, dealer, (buffer.lead_steps + 2) * buffer.groups_per_step, retry=retry)
    return RedisBufferServer(client, options.url, job, coordinator, vocab_size=vocab_size, config_hash=config_hash,
                             max_message_bytes=buffer.max_message_bytes, run_info=run_info,
                             reclaim_idle_s=redis.reclaim_idle_s, retry=retry, limits=limits,
                             shared_config=shared_config, stats_ttl_s=redis.lease_s, dealer=dealer, evals=evals)


def make_generator_buffer(buffer: BufferConfig, security: SecurityConfig, job_name: str,
                          generator_id: str) -> GeneratorBuffer:
    """A generator's connection to the learner's buffer (`job_name` names the Redis namespace when
    buffer.redis.namespace is unset)."""
    if buffer.backend == "zmq":
        from asyncrl.buffer.zmq.client import ZmqBufferClient
        from asyncrl.security.curve import client_keys

        return ZmqBufferClient(f"tcp://{buffer.host}:{buffer.port}", generator_id, buffer.request_timeout_s,
                               max_message_bytes=buffer.max_message_bytes,
                               keys=client_keys(security.keys_dir, security.client_name))
    from asyncrl.buffer.redis.client import RedisBufferClient
    from asyncrl.buffer.redis.conn import connect
    from asyncrl.buffer.redis.reconnect import Reconnecting

    options = redis_options(buffer.redis)
    return RedisBufferClient(connect(options), options.url, namespace(buffer.redis, job_name), generator_id,
                             buffer.lead_steps, buffer.groups_per_step, buffer.redis.lease_s,
                             retry=Reconnecting(options.url, buffer.redis.reconnect_s),
                             max_message_bytes=buffer.max_message_bytes)
