"""generator/main.py builds the generator's pieces in order and closes what it built in reverse, also when a step
fails part-way: here the engine cannot start (the model directory holds a tokenizer and no model), after the reward
workers and the weight stage were built. The error reaches the caller, and no reward worker process outlives it."""
import asyncio
import os

import pytest

from asyncrl.buffer.staleness import Coordinator
from asyncrl.buffer.zmq.server import ZmqBufferServer
from asyncrl.configs import load_config, shared_hash
from asyncrl.generator.main import run_generator_async
from tests.conftest import free_port
from tests.messages import run_info


def write_tokenizer(directory: str) -> str:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "b": 2}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>").save_pretrained(directory)
    return directory


def reward_workers_of(pid: int) -> list:
    """PIDs of the call-pool workers (generator/user_code/pool.py) started by process `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except (FileNotFoundError, PermissionError, NotADirectoryError, ProcessLookupError):
            continue
        if b"asyncrl.generator.user_code.pool_worker" in argv and str(pid).encode() in argv:
            found.append(int(entry))
    return found


def test_a_generator_whose_engine_fails_to_start_closes_what_it_had_built(tmp_path):
    model_dir = write_tokenizer(str(tmp_path / "model"))
    port = free_port()
    cfg = load_config(None, [f"buffer.port={port}", f"model.path={model_dir}", "generator.generator_id=broken",
                             "generator.engine=hf", "generator.model_source=local", "generator.reward_workers=2",
                             f"weightsync.shm_dir={tmp_path}", "buffer.request_timeout_s=5",
                             "generator.connect_timeout_s=10"])
    server = ZmqBufferServer("127.0.0.1", port, Coordinator(1, 2), vocab_size=16, config_hash=shared_hash(cfg),
                             max_message_bytes=4096, queue_groups=2,
                             run_info=run_info(model_path=model_dir, deals=True))
    server.start()
    try:
        with pytest.raises((OSError, ValueError), match="config.json"):  # transformers: no model here
            asyncio.run(run_generator_async(cfg, say=lambda line: None))
    finally:
        server.close()
    assert reward_workers_of(os.getpid()) == []
