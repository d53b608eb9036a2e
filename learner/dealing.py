"""The learner's side of dealing the job's prompts with the admissions (buffer/dealing.py): read the rows once on
rank 0, carry on from the checkpoint's cursor, and keep that cursor in the learner's state after every step."""
import logging

from asyncrl.buffer.dealing import DealError, PromptDealer
from asyncrl.configs.sections import part_seed
from asyncrl.data.prompts import PromptSet, encode_prompts
from asyncrl.learner.checkpoint import CheckpointError

log = logging.getLogger(__name__)


def build_dealer(prompts: PromptSet | None, data_cfg, seed: int, cursor: dict) -> tuple[PromptDealer | None, int]:
    """(the dealer, how many prompts were too long and left out). `prompts`: the job's rows and that count
    (data/prompts.py::load_train_prompts); None without data (a learner fed by scripted generators). `data_cfg` is
    the data section (shuffle, seed, epochs, deal timeout); `seed` the job's, used when data.seed is unset. With
    Redis the cursor lives in Redis and the checkpoint's only serves a Redis that lost it (buffer/redis/dealing.py)."""
    if prompts is None:
        return None, 0
    overlong = prompts.overlong
    if overlong:
        log.warning("learner: %d prompts longer than data.max_prompt_tokens=%d are left out", overlong,
                    data_cfg.max_prompt_tokens)
    dealer = PromptDealer(encode_prompts(prompts.rows), shuffle=data_cfg.shuffle,
                          seed=part_seed(data_cfg.seed, seed), epochs=data_cfg.epochs,
                          timeout_s=data_cfg.deal_timeout_s)
    if cursor:
        try:
            dealer.restore(cursor)
        except DealError as err:
            raise CheckpointError(str(err)) from None
    log.info("learner: dealing %d prompts (epoch %.2f%s)", dealer.size, dealer.metrics()["data/epoch"],
             f" of {data_cfg.epochs}" if data_cfg.epochs else "")
    return dealer, overlong
