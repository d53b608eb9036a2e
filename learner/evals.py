"""The learner's side of evaluation rounds during training: which versions are evaluated, opening a round when
one of them is published, and logging each round when the fleet has finished it (the protocol and the rounds'
state are buffer/eval_rounds.py).

A round is asked for by publishing a version, and it lands some steps later: its metrics are logged at the step
it evaluated, with eval/lag_steps saying how far training had moved on since.
"""
import logging
import time

from asyncrl.buffer.eval_rounds import EvalRounds, eval_due, first_due
from asyncrl.buffer.dealing import DealError
from asyncrl.data.prompts import PromptSet, decode_prompt, encode_prompts
from asyncrl.telemetry.eval_metrics import eval_metrics

log = logging.getLogger(__name__)
FINISH_MIN_PATIENCE_S = 5.0
"""At the end of the job, the least the learner waits for the next evaluation result before it gives up the rounds
still open (once it has seen answers: `Evaluations.finish`)."""
FINISH_PATIENCE_FACTOR = 3
"""... and it waits this many times the slowest answer seen (deal to result), so a slow fleet keeps its last round."""
FINISH_POLL_S = 0.2


def build_eval_rounds(eval_prompts: PromptSet | None, every_steps: int, timeout_s: float) -> EvalRounds | None:
    """The held-out prompts evaluated on the fleet (data/prompts.py::load_eval_prompts: the rows and how many were
    too long); None without them (eval.every_steps and eval.before_train off, or no eval prompts)."""
    if eval_prompts is None:
        return None
    if eval_prompts.overlong:
        log.warning("learner: %d eval prompts longer than data.max_prompt_tokens are left out", eval_prompts.overlong)
    log.info("learner: evaluating on %s (%d prompts) every %d steps on the fleet", eval_prompts.source or
             "held-out prompts", len(eval_prompts.rows), every_steps)
    return EvalRounds(encode_prompts(eval_prompts.rows), timeout_s)


def eval_samples(samples: list) -> list:
    """A finished round's (row bytes, texts, rewards) per prompt as (prompt token ids, texts, rewards): the rows are
    the learner's own encoding of its eval prompts (EvalRounds.blobs), so one that does not decode is a bug, said
    and left out of the table."""
    out = []
    for blob, texts, rewards in samples:
        try:
            out.append((decode_prompt("eval", blob).prompt_ids, texts, rewards))
        except DealError as err:
            log.warning("learner: an evaluation prompt of the samples table does not decode: %s", err)
    return out


class Evaluations:
    """Opens the due rounds and logs the finished ones into `record` (telemetry/run_record.py). `rounds` is None
    when the job evaluates nothing; then every method is a no-op. `eval_cfg` is the eval section; `max_tokens`
    the length a round samples up to (eval.max_tokens, else rollout.max_tokens); `source` names the data (the
    eval PromptSet's), in every line logged, so a number is never read as another data's."""

    def __init__(self, rounds: EvalRounds | None, eval_cfg, max_tokens: int, start_version: int, record,
                 source: str = "held-out prompts"):
        self.rounds = rounds
        self.source = source or "held-out prompts"
        self.cfg = eval_cfg
        self.max_tokens = max_tokens
        self.record = record
        self._next_due = first_due(start_version, eval_cfg.every_steps)

    def open_if_due(self, version: int) -> None:
        """Version 0 with eval.before_train; then the first published version at or past each multiple of
        eval.every_steps (with weightsync.every_steps > 1 not every multiple is published)."""
        due, self._next_due = eval_due(version, self._next_due, self.cfg.every_steps, self.cfg.before_train)
        if self.rounds is not None and due:
            self.rounds.open(version, self.cfg.n, self.cfg.temperature, self.max_tokens)

    def log_finished(self, published: int) -> int:
        """Log each round that finished since the last call at its own step, with eval/lag_steps (the versions
        published since it was asked for: `published` is the newest); returns how many are still open."""
        if self.rounds is None:
            return 0
        for finished in self.rounds.finished():
            metrics = eval_metrics(finished.results, list(self.cfg.k_values), self.cfg.pass_threshold)
            metrics["eval/lag_steps"] = float(published - finished.version)
            self.record.log_eval(finished.version, metrics)
            self.record.log_eval_samples(finished.version, eval_samples(finished.samples))
            log.info("learner: evaluation of v%d on %s: mean reward %.4f over %d prompts (landed %d steps later)",
                     finished.version, self.source, metrics["eval/all/mean_reward"], int(metrics["eval/all/prompts"]),
                     published - finished.version)
        return len(self.rounds.open_versions())

    def after_step(self, published: int) -> dict:
        """Between steps: log what finished; the step's eval metrics ({} when the job evaluates nothing)."""
        if self.rounds is None:
            return {}
        self.log_finished(published)
        return {"eval/rounds_abandoned": float(self.rounds.abandoned)}

    def finish(self, published: int, live_generators, serve=lambda: None,
               min_patience_s: float = FINISH_MIN_PATIENCE_S) -> None:
        """At the end of the job (training is over, so nothing here holds it back), wait for the rounds still open
        so the last evaluation is logged too, but only for rounds that can still finish:

        - a round no live generator can serve (`EvalRounds.unservable`: pinned to its version, and every live
          engine is past it, as for a generator that joined at v1 and the v0 round) is abandoned at once;
        - the wait ends when no result has landed for FINISH_PATIENCE_FACTOR times the slowest answer seen in this
          job (at least `min_patience_s`), so a generator that holds a prompt and never answers holds the end only
          that long; before any answer was seen that bound is eval.timeout_s, as it is in any case.

        `live_generators()` names the generators heard from recently; `serve()` moves results and prompts between
        the fleet and the rounds (LearnerBuffer.serve_evals: with Redis nobody calls take any more)."""
        if self.rounds is None:
            return
        start, abandoned = self.rounds.clock(), self.rounds.abandoned
        why = None
        while True:
            serve()
            if not self.log_finished(published):
                break
            why = self._why_stop_waiting(live_generators(), start, min_patience_s)
            if why is not None:
                self.rounds.abandon(self.rounds.open_versions())
                break
            time.sleep(FINISH_POLL_S)
        given_up = self.rounds.abandoned - abandoned
        (log.warning if given_up else log.info)(
            "learner: waited %.1f s after the last step for the last evaluations; %d rounds abandoned%s",
            self.rounds.clock() - start, given_up, f" ({why})" if why else "")

    def _why_stop_waiting(self, live: list, start: float, min_patience_s: float) -> str | None:
        """None while an open round can still be answered, else why none can (rounds nobody can serve are
        abandoned here, with a warning, and the others still waited for)."""
        unservable = self.rounds.unservable(live)
        if unservable:
            self.rounds.abandon(unservable)
            log.warning("learner: evaluations of %s abandoned: no live generator can serve them (a round is pinned "
                        "to its version; live engines: %s)", [f"v{version}" for version in unservable],
                        {gen: self.rounds.engines.get(gen) for gen in live} or "none")
        now, slowest = self.rounds.clock(), self.rounds.slowest_answer_s
        if now - start >= self.cfg.timeout_s:
            return f"eval.timeout_s={self.cfg.timeout_s:g} ran out"
        patience = max(min_patience_s, FINISH_PATIENCE_FACTOR * slowest) if slowest else self.cfg.timeout_s
        last = max(start, self.rounds.last_result_at or start)
        if now - last >= patience:
            return (f"no result for {now - last:.1f} s, {FINISH_PATIENCE_FACTOR}x the slowest answer seen "
                    f"({slowest:.1f} s), at least {min_patience_s:g} s")
        return None
