"""The `asyncrl` command line: parse and dispatch. Each command builds its part, runs it and closes it; what the
commands share with `asyncrl run`'s supervisor (the job directory, the learner's ranks, console output) is in
launch/job.py. Torch and vLLM are imported only after parsing, so `--help`, `--dry-run` and `asyncrl config`
answer fast."""
import argparse
import importlib.util
import json
import logging
import os
import signal
import sys

from asyncrl.launch.job import (exec_torchrun, print_sft_result, print_summary, resolve_rl_inputs, resolve_sft_inputs,
                                run_on_ranks, say_stderr)

COMMANDS = {
    "run": "start a whole job on this machine: learner, generator and embedded buffer",
    "learner": "the learner (hosts the embedded buffer)",
    "generator": "one generator; start as many as you like, whenever you like",
    "sft": "supervised fine-tuning on the learner's stack",
    "eval": "evaluate a checkpoint or an exported model on eval.files and print a table per data source",
    "reward-server": "serve a reward model (reward_server.kind=classifier) or an LLM judge (judge) to the generators",
    "plan": "simulate the job to size the fleet: throughput, staleness and idle time per generator count and eta",
    "slurm": "write sbatch scripts for the job on a SLURM cluster: a learner job and a generator array",
    "ray": "run the job on a Ray cluster (`asyncrl ray scale JOB --generators N` resizes its fleet)",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="asyncrl", description="Fully asynchronous off-policy RL for LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        cmd.add_argument("--config", default=None,
                         help="recipe YAML: a path, or a recipe shipped in asyncrl/configs (default demo_cpu.yaml)")
        cmd.add_argument("--dry-run", action="store_true",
                         help="print the resolved config as YAML, each value marked with the recipe or the command "
                              "line that set it, and exit")
        cmd.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. buffer.max_staleness=4 learner.lr=1e-6")
        if name in ("learner", "sft"):
            add_launch_arguments(cmd, resume=True)
        if name == "eval":
            cmd.add_argument("--checkpoint", required=True,
                             help="an HF model directory (asyncrl export's output) or a learner checkpoint")
            cmd.add_argument("--files", nargs="+", default=None, help="parquet prompts (same as eval.files=[...])")
        if name == "plan":
            from asyncrl.launch.plan import add_plan_arguments

            add_plan_arguments(cmd)
        if name == "slurm":
            from asyncrl.launch.slurm import add_slurm_arguments

            add_slurm_arguments(cmd)
        if name == "ray":
            from asyncrl.launch.ray_job import add_ray_arguments

            add_ray_arguments(cmd)
        if name == "run":
            cmd.add_argument("--nproc", type=int, default=1, help="learner ranks (torchrun; default 1)")
            cmd.add_argument("--generators", type=int, default=1,
                             help="generator processes, named gen-0, gen-1, ... (default 1)")
    add_export_parser(sub)
    add_data_parser(sub)
    add_keys_parser(sub)
    add_config_parser(sub)
    add_init_model_parser(sub)
    return parser


def add_launch_arguments(cmd, resume: bool) -> None:
    """Ranks and restarts of the learner. --nproc re-executes the command under torchrun (torch.distributed.run),
    one process per rank; --nnodes/--node-rank/--master-addr/--master-port span machines (static rendezvous:
    start the same command on every node with its own --node-rank)."""
    cmd.add_argument("--nproc", type=int, default=1, help="learner ranks on this machine (default 1)")
    cmd.add_argument("--nnodes", type=int, default=1, help="machines in the learner (default 1)")
    cmd.add_argument("--node-rank", type=int, default=0, help="this machine's index among --nnodes")
    cmd.add_argument("--master-addr", default="127.0.0.1", help="address of node 0 for the rendezvous")
    cmd.add_argument("--master-port", type=int, default=0, help="port on node 0 (default: a free one; set it when "
                     "--nnodes > 1)")
    if not resume:
        return
    cmd.add_argument("--resume", nargs="?", const="auto", default=None, metavar="CHECKPOINT",
                     help="continue from a checkpoint (a step-* dir or a checkpoint root); with no value, the newest "
                          "in the checkpoint directory (learner.resume=auto)")


def add_export_parser(sub) -> None:
    """`export` reads a checkpoint, not a recipe: it takes no --config or overrides."""
    help_text = "write a checkpoint's weights, config and tokenizer as an HF model directory (safetensors)"
    cmd = sub.add_parser("export", help=help_text, description=help_text)
    cmd.add_argument("--checkpoint", required=True,
                     help="a step-* checkpoint directory, or a checkpoint root (its latest checkpoint is used)")
    cmd.add_argument("--out", required=True, help="output directory for the HF model")
    cmd.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                     help="dtype of the exported weights (default: the config's dtype, else float32)")
    cmd.add_argument("--adapter-out", default=None,
                     help="a LoRA checkpoint only: also write its PEFT adapter directory here (the model in --out is "
                          "always the merged one)")


def add_data_parser(sub) -> None:
    """`data` reads a local dataset file, not a recipe (launch/datasets.py)."""
    help_text = "turn a local copy of GSM8K or MATH (jsonl or parquet, the dataset's columns) into verl parquet"
    cmd = sub.add_parser("data", help=help_text, description=help_text)
    cmd.add_argument("dataset", choices=["gsm8k", "math"])
    cmd.add_argument("--input", required=True, help="the dataset file: .jsonl or .parquet")
    cmd.add_argument("--out", required=True, help="output directory; writes <split>.parquet there")
    cmd.add_argument("--split", default="train", help="split name: the file name and extra_info.split")
    cmd.add_argument("--data-source", default="DigitalLearningGmbH/MATH-lighteval",
                     help="math only: the data_source to write (a name the built-in math scorer knows)")


def add_keys_parser(sub) -> None:
    """`keys` writes files, not a job: it takes no --config or overrides."""
    help_text = "make ZeroMQ CURVE keys for the buffer and the weight catch-up server (security.keys_dir)"
    cmd = sub.add_parser("keys", help=help_text, description=help_text)
    cmd.add_argument("dir", help="the keys directory: server.key(_secret) and clients/<name>.key(_secret)")
    cmd.add_argument("--clients", nargs="+", default=["generator"],
                     help="client names, one key pair each (default: generator, shared by the fleet)")


def add_config_parser(sub) -> None:
    """`config` documents the keys; it reads no recipe (the defaults it shows are the dataclasses')."""
    help_text = "print config keys with their type, default and description (all, one section, or one key)"
    cmd = sub.add_parser("config", help=help_text, description=help_text)
    cmd.add_argument("key", nargs="?", default=None, help="a section (buffer, buffer.redis) or a key "
                                                            "(buffer.max_staleness); all sections without one")
    cmd.add_argument("--markdown", action="store_true", help="all sections as the Markdown of docs/config.md")


def add_init_model_parser(sub) -> None:
    """`init-model` writes a new model directory from text files (learner/init_model.py); it reads no recipe."""
    from asyncrl.learner.init_model import FAMILIES, ModelShape

    help_text = ("build a tokenizer from your task's text and a small random-init model of a supported family, as "
                 "an HF model directory (then `asyncrl sft ... model.path=DIR` warms it up)")
    cmd = sub.add_parser("init-model", help=help_text, description=help_text)
    cmd.add_argument("--out", required=True, help="the model directory to write")
    cmd.add_argument("--corpus", required=True, nargs="+", action="extend", metavar="FILE",
                     help="the task's text: verl or chat rows (.parquet, .jsonl) or plain text; every character the "
                          "task uses must be in it (repeat or list several files)")
    cmd.add_argument("--family", default="qwen2", choices=FAMILIES, help="model family (default qwen2)")
    cmd.add_argument("--hidden", type=int, default=ModelShape.hidden_size, help="hidden size (default %(default)s)")
    cmd.add_argument("--layers", type=int, default=ModelShape.num_layers, help="decoder layers (default %(default)s)")
    cmd.add_argument("--heads", type=int, default=0, help="attention heads (default: hidden / 32)")
    cmd.add_argument("--kv-heads", type=int, default=0, help="key/value heads (default: as many as --heads)")
    cmd.add_argument("--max-positions", type=int, default=ModelShape.max_positions,
                     help="longest prompt + response in tokens (default %(default)s)")
    cmd.add_argument("--tokenizer", default="char", choices=["char", "bpe"],
                     help="char: one token per character (byte-level, no merges; default); bpe: frequent words and "
                          "pieces become tokens, up to --vocab-size")
    cmd.add_argument("--vocab-size", type=int, default=0, help="bpe only: the vocabulary its merges stop at")
    cmd.add_argument("--all-bytes", action="store_true",
                     help="put all 256 byte symbols in the vocabulary, so text with characters the corpus lacks "
                          "still round-trips (~200 more tokens)")
    cmd.add_argument("--chat-template", default=None, metavar="FILE",
                     help="a Jinja chat template file (default: Qwen-style <|im_start|>role ... <|im_end|>)")
    cmd.add_argument("--seed", type=int, default=0, help="seed of the random initialisation (default 0)")
    cmd.add_argument("--force", action="store_true", help="overwrite a model already in --out")


def cmd_init_model(args) -> int:
    from asyncrl.data.corpus import CorpusError
    from asyncrl.learner.init_model import InitModelError, ModelShape, init_model
    from asyncrl.learner.tokenizer import TokenizerRoundTripError, TokenizerSpec

    try:
        template = open(args.chat_template, encoding="utf-8").read() if args.chat_template else None
        spec = TokenizerSpec(model="bpe" if args.tokenizer == "bpe" else "byte_level", vocab_size=args.vocab_size,
                             all_bytes=args.all_bytes, **({"chat_template": template} if template else {}))
        shape = ModelShape(args.family, args.hidden, args.layers, args.heads, args.kv_heads, args.max_positions)
        built = init_model(args.out, args.corpus, shape, spec, args.seed, overwrite=args.force)
    except (CorpusError, InitModelError, TokenizerRoundTripError, ValueError, OSError) as err:
        print(f"asyncrl init-model: {err}", file=sys.stderr)
        return 2
    print(f"init-model: wrote {built.path}: {built.family}, {built.parameters:,} parameters, {built.tokens} tokens "
          f"(vocabulary padded to {built.vocab_size}); the tokenizer gives back all {built.texts} corpus texts and "
          f"{built.rendered} chat renderings")
    rows = next((path for path in args.corpus if path.endswith(".parquet")), "train.parquet")
    print(f"next: asyncrl sft model.path={built.path} data.train_files=[{rows}] sft.save_dir={built.path}-sft  "
          f"(warm it up on your training rows, not the held-out ones; then asyncrl run with "
          f"model.path={built.path}-sft)")
    return 0


def cmd_config(args) -> int:
    from asyncrl.configs.reference import format_markdown, format_text, lookup

    if args.markdown:
        print(format_markdown(), end="")
        return 0
    try:
        chosen = lookup(args.key)
    except KeyError as err:
        print(f"asyncrl config: {err.args[0]}", file=sys.stderr)
        return 2
    print(format_text(chosen), end="")
    return 0


def cmd_keys(args) -> int:
    from asyncrl.security.curve import make_keys

    bad = [name for name in args.clients if not name or "/" in name or name.startswith(".")]
    if bad:
        print(f"asyncrl keys: client names must be plain file names, got {bad}", file=sys.stderr)
        return 2
    written = make_keys(args.dir, args.clients)
    directory = os.path.abspath(args.dir)
    print(f"keys: wrote {len(written)} files in {directory}" + ("" if written else " (all existed; kept)"))
    print(f"  learner: security.keys_dir={directory} (reads server.key_secret and clients/*.key)")
    print(f"  generator host: copy server.key and clients/<name>.key_secret to a keys dir there, then "
          f"security.keys_dir=<that dir> security.client_name=<name>")
    return 0


def cmd_data(args) -> int:
    from asyncrl.launch.datasets import DataPrepError, convert

    try:
        path, written, skipped = convert(args.dataset, args.input, args.out, args.split, args.data_source)
    except DataPrepError as err:
        print(f"asyncrl data: {err}", file=sys.stderr)
        return 2
    print(f"data: wrote {written} rows to {os.path.abspath(path)}" +
          (f"; skipped {skipped} without a usable answer" if skipped else ""))
    return 0


def main(argv=None) -> int:
    """Parse, then dispatch: the commands that read no recipe first, then load the recipe and run the command."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if os.environ.pop("ASYNCRL_DIE_WITH_PARENT", "") == "1":  # a child of a Ray actor (launch/ray_actors.py)
        from asyncrl.launch.job import die_with_parent

        die_with_parent()
    if argv[:2] == ["ray", "scale"]:  # reads no recipe: it reaches a running job's fleet by the job's name
        from asyncrl.launch.ray_job import cmd_ray_scale

        return cmd_ray_scale(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command in RECIPELESS_FUNCS:
        if args.command in ("export", "data", "init-model"):
            quiet_third_party()
        return RECIPELESS_FUNCS[args.command](args)
    from asyncrl.configs import ConfigError
    from asyncrl.configs.recipes import load_with_sources

    try:
        loaded = load_with_sources(args.config, overrides_of(args))
    except ConfigError as err:
        print(f"asyncrl {args.command}: {err}", file=sys.stderr)
        return 2
    if args.dry_run:
        from asyncrl.configs.provenance import format_with_sources

        print(format_with_sources(loaded), end="")
        return 0
    cfg = loaded.config
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_third_party()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # run `finally` blocks: sockets, shm, MLflow flush
    try:
        return COMMAND_FUNCS[args.command](cfg, args)
    except KeyboardInterrupt:
        print(f"asyncrl {args.command}: interrupted", file=sys.stderr)
        return 130


def quiet_third_party() -> None:
    """Silence what libraries print that a user cannot act on, through their documented switches, in the
    environment so that every child (`asyncrl run`'s learner and generators, torchrun's ranks) inherits it; a value
    the user set wins. transformers draws a progress bar for every model it loads or saves (a tiny model, a few ms);
    MLflow logs its store's migrations at INFO (where the run is, asyncrl prints).
    transformers' generation code imports accelerate, which imports DeepSpeed when it is installed (the
    `deepspeed` extra), and DeepSpeed warns "Setting accelerator to CPU" on every machine without a GPU: on such a
    machine CPU is the only accelerator, so naming it (DS_ACCELERATOR) is what the warning asks for. With a GPU
    DeepSpeed's own detection is left alone. Whether there is a GPU is read from the device files the drivers
    create, not from torch: importing torch takes a second, and `init-model --help` or a mistyped corpus path must
    answer at once."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # "Creating initial MLflow database tables..."
    if ("DS_ACCELERATOR" not in os.environ and not has_gpu_devices()
            and importlib.util.find_spec("deepspeed") is not None):
        os.environ["DS_ACCELERATOR"] = "cpu"


GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")
"""What the NVIDIA and AMD (ROCm) kernel drivers create; a machine without either has no GPU torch could use."""


def has_gpu_devices() -> bool:
    """A GPU driver is loaded and CUDA_VISIBLE_DEVICES does not hide every device."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return any(os.path.exists(path) for path in GPU_DEVICE_FILES)


def overrides_of(args) -> list:
    """The dotlist overrides, with the options that are overrides in disguise folded in: `eval --files` is
    eval.files, `--resume [CHECKPOINT]` is learner.resume. The list is also stored back on `args`, so a command
    that re-executes itself (torchrun) passes the same ones on."""
    if args.command == "eval" and args.files:
        # `--files a b key=value`: argparse hands the overrides after --files to it; they are overrides
        args.overrides += [item for item in args.files if "=" in item]
        files = [item for item in args.files if "=" not in item]
        args.overrides.append(f"eval.files=[{','.join(json.dumps(f) for f in files)}]")
    if getattr(args, "resume", None):
        if "=" in args.resume and not os.path.exists(args.resume):  # `--resume a.b=c`: an override, not a path
            args.overrides, args.resume = [args.resume, *args.overrides], "auto"
        args.overrides = [*args.overrides, f"learner.resume={args.resume}"]
    if args.command == "slurm":  # checked as the jobs run it: in Redis (not stored back: the scripts add it)
        return [*args.overrides, "buffer.backend=redis", f"buffer.redis.url={args.redis_url}"]
    return args.overrides


def _exit_on_sigterm(signum, frame):
    raise SystemExit(143)


def eval_files(cfg) -> list | None:
    """The held-out files evaluated during training (data/prompts.py::load_eval_prompts reads them): eval.files, or
    the demo's held-out split when the demo is active (configs/sections.py::demo_active); None otherwise
    (data.val_fraction's split or no evaluation: `training_eval_prompts`)."""
    if cfg.eval.files:
        return list(cfg.eval.files)
    from asyncrl.configs.sections import demo_active

    if demo_active(cfg.demo, cfg.model, cfg.data):
        from asyncrl.launch.demo import heldout_file

        return [heldout_file(cfg.demo, cfg.job.seed)]
    return None


def training_eval_prompts(cfg, model_path: str, files: list):
    """The prompts the fleet evaluates while training, each set named by its data (PromptSet.source): eval.files;
    else data.val_fraction's held-out split of the training data; else, for the demo, its held-out split; else
    none. Whatever the answer, it is said once, at start. Raises DatasetError for eval.files with
    data.val_fraction (which of them would be the evaluation's is a guess)."""
    from asyncrl.data.prompts import DatasetError, load_eval_prompts, load_held_out_prompts

    log = logging.getLogger(__name__)
    if cfg.eval.files and cfg.data.val_fraction:
        raise DatasetError(f"eval.files and data.val_fraction={cfg.data.val_fraction} are both set: evaluate on "
                           f"your held-out files (eval.files) or on a split of the training data "
                           f"(data.val_fraction), not both")
    if not (cfg.eval.every_steps or cfg.eval.before_train):
        held = f" (data.val_fraction={cfg.data.val_fraction}'s rows are held out all the same)" \
            if cfg.data.val_fraction else ""
        log.info("learner: no evaluation while training: eval.every_steps=0 and eval.before_train=false%s", held)
        return None
    from asyncrl.configs import training_eval_blocker

    blocker = training_eval_blocker(cfg)
    if blocker is not None:
        log.warning("no evaluation while training: eval.every_steps is set but this job does not evaluate while "
                    "training: %s (asyncrl eval evaluates its checkpoints)", blocker)
        return None
    trust, max_tokens = cfg.model.trust_remote_code, cfg.data.max_prompt_tokens
    if cfg.data.val_fraction:
        prompts, trained = load_held_out_prompts(cfg.data, files, model_path, cfg.job.seed, trust)
        log.info("learner: eval: %d prompts held out (%s, data.val_fraction=%s, seed %d); training on %d",
                 len(prompts.rows) + prompts.overlong, prompts.source, cfg.data.val_fraction, cfg.job.seed, trained)
        return prompts
    held_out = eval_files(cfg)
    if held_out is None:
        log.warning("learner: no evaluation while training: no eval.files and data.val_fraction=0 (set "
                    "eval.files=[test.parquet], or data.val_fraction=0.1 to hold out a split of the training data)")
        return None
    source = "the demo's held-out split" if not cfg.eval.files else ""
    return load_eval_prompts(held_out, model_path, max_tokens, trust, source=source)


def load_learner_prompts(cfg, model_path: str, files: list) -> tuple:
    """(the prompts rank 0 deals, the held-out prompts its evaluation rounds deal), each None when there are none."""
    from asyncrl.data.prompts import load_train_prompts

    eval_prompts = training_eval_prompts(cfg, model_path, files)
    prompts = load_train_prompts(cfg.data, files, model_path, cfg.job.seed, cfg.model.trust_remote_code)
    return prompts, eval_prompts


def cmd_learner(cfg, args) -> int:
    """Join the ranks, build and run the learner, close."""
    if args.nproc * args.nnodes > 1 and "LOCAL_RANK" not in os.environ:
        return exec_torchrun(cfg.job, args, module="asyncrl.learner", command_name="learner")
    from asyncrl.buffer.dealing import DealError
    from asyncrl.data.prompts import DatasetError
    from asyncrl.learner.checkpoint import CheckpointError
    from asyncrl.learner.learnable import NothingToLearn
    from asyncrl.learner.loop import TrainingPoisoned, run_learner
    from asyncrl.security.curve import KeysError

    def train(model_path: str, files: list, job_dir: str, parallel) -> int:
        try:
            prompts, eval_prompts = load_learner_prompts(cfg, model_path, files) if parallel.is_main else (None, None)
            summary = run_learner(cfg, model_path, files, job_dir, parallel, prompts=prompts,
                                  eval_prompts=eval_prompts)
        except (TrainingPoisoned, NothingToLearn) as err:
            print(f"asyncrl learner: {err}", file=sys.stderr)
            return 1
        if summary is not None:
            print_summary(summary)
        return 0

    return run_on_ranks("learner", cfg.learner, cfg.job, lambda: resolve_rl_inputs(cfg), train,
                        errors=(CheckpointError, DatasetError, DealError, KeysError))


def cmd_generator(cfg, args) -> int:
    from asyncrl.generator.main import run_generator

    return run_generator(cfg, say=say_stderr)


def cmd_sft(cfg, args) -> int:
    """SFT on the learner's stack; with --nproc N, on N ranks (FSDP2, learner.sp_size for Ulysses)."""
    if args.nproc * args.nnodes > 1 and "LOCAL_RANK" not in os.environ:
        return exec_torchrun(cfg.job, args, module="asyncrl.launch.cli", command_name="sft")
    from asyncrl.learner.checkpoint import CheckpointError
    from asyncrl.data.sft import SFTDataError
    from asyncrl.learner.sft_job import run_sft_job

    def train(model_path: str, files: list, job_dir: str, parallel) -> int:
        say = say_stderr if parallel.is_main else (lambda message: None)
        result = run_sft_job(cfg, model_path, files, job_dir, parallel, say)
        if parallel.is_main:
            print_sft_result(result)
        return 0

    return run_on_ranks("sft", cfg.learner, cfg.job, lambda: resolve_sft_inputs(cfg), train,
                        errors=(SFTDataError, FileNotFoundError, CheckpointError))


def cmd_run(cfg, args) -> int:
    from asyncrl.launch.supervisor import run_job

    if args.nproc < 1 or args.generators < 1:
        print(f"asyncrl run: --nproc and --generators must be >= 1, got {args.nproc} and {args.generators}",
              file=sys.stderr)
        return 2
    if args.generators > 1 and cfg.generator.generator_id:
        print(f"asyncrl run: --generators {args.generators} with "
              f"generator.generator_id={cfg.generator.generator_id!r}: "
              f"each generator needs its own id; leave it unset (they are named gen-0, gen-1, ...)", file=sys.stderr)
        return 2
    return run_job(cfg, args.config, args.overrides, generators=args.generators,
                   learner_args=["--nproc", str(args.nproc)] if args.nproc > 1 else [])


def cmd_export(args) -> int:
    from asyncrl.learner.checkpoint import CheckpointError
    from asyncrl.learner.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out, args.dtype, adapter_dir=args.adapter_out)
    except CheckpointError as err:
        print(f"asyncrl export: {err}", file=sys.stderr)
        return 2
    print(f"export: wrote {os.path.abspath(out)}")
    if args.adapter_out:
        print(f"export: wrote the LoRA adapter to {os.path.abspath(args.adapter_out)}")
    return 0


def cmd_eval(cfg, args) -> int:
    from asyncrl.launch.evaluate import cmd_eval as evaluate_command

    return evaluate_command(cfg, args)


def cmd_reward_server(cfg, args) -> int:
    """Serve until interrupted (Ctrl-C: 130, SIGTERM: 143, as every command); a model it cannot load or a port it
    cannot bind ends it with 2 and the reason."""
    from asyncrl.generator.event_loop import run as run_event_loop
    from asyncrl.generator.reward_server.app import serve

    try:
        run_event_loop(serve(cfg.reward_server, say=say_stderr), cfg.generator.event_loop)
    except (ValueError, OSError) as err:
        print(f"asyncrl reward-server: {err}", file=sys.stderr)
        return 2
    return 0


def cmd_plan(cfg, args) -> int:
    from asyncrl.launch.plan import cmd_plan as plan_command

    return plan_command(cfg, args)


def cmd_ray(cfg, args) -> int:
    from asyncrl.launch.ray_job import cmd_ray as ray_command

    return ray_command(cfg, args)


def cmd_slurm(cfg, args) -> int:
    from asyncrl.launch.slurm import cmd_slurm as slurm_command

    return slurm_command(cfg, args)


RECIPELESS_FUNCS = {"export": cmd_export, "data": cmd_data, "keys": cmd_keys, "config": cmd_config,
                    "init-model": cmd_init_model}
"""Commands that read no recipe (no --config, no overrides)."""
COMMAND_FUNCS = {"run": cmd_run, "learner": cmd_learner, "generator": cmd_generator, "sft": cmd_sft,
                 "eval": cmd_eval, "reward-server": cmd_reward_server, "plan": cmd_plan, "slurm": cmd_slurm,
                 "ray": cmd_ray}

if __name__ == "__main__":
    sys.exit(main())
