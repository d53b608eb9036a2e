"""The `asyncrl sft` job on this rank: build the policy (FSDP2, Ulysses) and the examples, run SFT on the learner's
own stack (learner/sft.py), save the full model. Parse, build, run, save; the CLI (launch/cli.py) only resolves
where the model and data are and joins the ranks."""
import logging
import os
from dataclasses import dataclass

import torch

from asyncrl.learner.build import build_policy
from asyncrl.learner.model import load_tokenizer
from asyncrl.learner.parallel import ParallelState
from asyncrl.learner.publish import iter_full_weights
from asyncrl.learner.sft import run_sft
from asyncrl.learner.sft_data import read_sft_examples
from asyncrl.learner.train_step import StepSettings

log = logging.getLogger(__name__)
SAVE_BUCKET_BYTES = 256 << 20
"""The full weights are gathered from the FSDP shards this many bytes at a time when the model is saved."""


@dataclass
class SFTResult:
    losses: list
    """The loss of every step."""
    out_dir: str
    """The saved HF model directory."""


def run_sft_job(cfg, model_path: str, files: list, job_dir: str, parallel: ParallelState, say) -> SFTResult:
    """SFT of `model_path` on `files` (chat parquet with `messages`, or verl rows) for sft.steps steps; the model and
    tokenizer are saved to <job_dir>/model by rank 0. Raises SFTDataError / FileNotFoundError for unusable data."""
    torch.manual_seed(cfg.sft.seed)
    tokenizer = load_tokenizer(model_path, trust_remote_code=cfg.model.trust_remote_code)
    model = build_policy(cfg, model_path, parallel)
    examples = read_sft_examples(files, tokenizer, cfg.sft.max_length or None, cfg.sft.truncation)
    settings = StepSettings(version=0, max_staleness=0, max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch,
                            chunk_tokens=cfg.learner.logprob_chunk_tokens, grad_clip=cfg.learner.grad_clip,
                            packing=cfg.learner.packing, fp32_head=cfg.model.lm_head_fp32, parallel=parallel)

    def on_step(step: int, total: int, loss: float) -> None:
        if step % 10 == 0 or step == total:
            say(f"sft step {step}/{total} loss {loss:.4f}")

    losses = run_sft(model, examples, cfg.sft.steps, cfg.sft.lr, cfg.sft.batch_size, cfg.sft.seed, settings,
                     on_step=on_step if parallel.is_main else None)
    out_dir = os.path.join(job_dir, "model")
    weights = dict(iter_full_weights(model, parallel, torch.float32, SAVE_BUCKET_BYTES))  # every rank gathers
    if parallel.is_main:
        model.save_pretrained(out_dir, state_dict=weights)
        tokenizer.save_pretrained(out_dir)
    return SFTResult(losses, out_dir)
