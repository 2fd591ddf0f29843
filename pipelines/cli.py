"""``orchestra train CONFIG.yaml key=value ... [--resume | --overwrite]``: run a training job from a typed config.

``orchestra train --help-config`` prints every config key with its type, default and description, and exits 0.

User errors are printed as ``orchestra train: <what went wrong and what to change>`` on stderr with exit status 2:
a bad config (a config file that is missing or a directory, a model.path or data.train_path that is not what it
should be), an output_dir that is a file, lies under one, holds an earlier run or is in use by another run (a run
holds ``<output_dir>/.orchestra.lock`` until it ends), a missing or corrupt checkpoint (all found before torch or Ray
is imported); a model that does not fit the task's tokenizer, fewer prompts than a step takes, resources.device=cuda
with in-process workers and no GPU (found before any worker starts); pools the cluster cannot place when the job
starts; and a checkpoint that does not fit the configured model or worker count (found when the workers load it). A
run that stops because training diverged (``runner.max_bad_steps`` non-finite steps, or a step whose updates were
all skipped) or because a worker died past ``runner.max_restarts`` prints
``orchestra train: ...`` with exit status 1. SIGINT (Ctrl-C) and SIGTERM cancel the run cleanly (its cleanup runs:
metrics.jsonl holds whole lines, the trace is saved with runner.trace, the cluster shuts down; a second signal ends
the process at once) and print ``orchestra train: interrupted (SIGTERM) at step N; the newest checkpoint is
<output_dir>/checkpoints/step_K (after step K), so steps K+1-(N-1) are run again; resume with --resume``, N being
the first step not finished (with no checkpoint yet, it says that --resume has nothing to continue from), with exit
status 128 + the signal: 130 for SIGINT, 143 for SIGTERM. A traceback means a bug.
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["main"]


def _exit_now(code: int) -> None:
    """End the process with ``code`` once the interrupted run's own cleanup is done, without the interpreter's
    teardown: an in-process rank's thread that was inside a collective when the run was cancelled cannot be joined,
    and C++ teardown of such a thread aborts the process (SIGABRT), which would turn the documented 130/143 into a
    crash. Output and logs are flushed first."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``orchestra`` command."""
    p = argparse.ArgumentParser(prog="orchestra", description="orchestra: async RL post-training on Ray")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="run a GRPO or PPO job", description="Run a training job. Overrides are "
                       "section.key=value (e.g. actor.lr=1e-3 runner.total_steps=50).")
    t.add_argument("config", nargs="?", help="YAML config file (omit for the defaults)")
    t.add_argument("overrides", nargs="*", help="section.key=value overrides")
    again = t.add_mutually_exclusive_group()
    again.add_argument("--resume", action="store_true", help="continue from the newest good checkpoint in "
                       "runner.output_dir (checked before the cluster starts)")
    again.add_argument("--overwrite", action="store_true", help="start over in a runner.output_dir that holds an "
                       "earlier run: removes the files a run writes there (checkpoints, metrics.jsonl, config.json, "
                       "TensorBoard events, reward.png, traces) and nothing else; without it such a run is refused")
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--help-config", action="store_true", help="list every config key (section.key) with its type, "
                   "default and description, and exit")
    args, extra = p.parse_known_args(argv)  # the file and overrides may follow the flags: `train JOB.yaml --resume k=v`
    if extra and (args.command != "train" or any(a.startswith("-") for a in extra)):
        p.parse_args(argv)  # argparse's own error (exit 2) for what it does not know

    from .config import ConfigError, config_help, load_config

    if args.help_config:
        try:
            print(config_help(), flush=True)
        except BrokenPipeError:  # `orchestra train --help-config | head`: the reader has what it wanted
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0

    config, *overrides = [*([args.config] if args.config is not None else []), *args.overrides, *extra] or [None]
    if config is not None and "=" in config and not config.endswith((".yaml", ".yml")):
        config, overrides = None, [config, *overrides]
    misplaced = [o for o in overrides if "=" not in o]
    if misplaced:
        o = misplaced[0]
        if o.endswith((".yaml", ".yml")):  # e.g. `train k=v JOB.yaml`: the file would be read as an override
            why = (f"a config file comes first, and one only: orchestra train {o} [section.key=value ...] [flags]"
                   + (f" (given after {config})" if config is not None else ""))
        else:  # e.g. `train JOB.yaml actor.lr`
            why = f"an override is section.key=value: write {o}=VALUE"
        print(f"orchestra train: {o!r} is not a section.key=value override; {why}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        print(f"orchestra train: {e}", file=sys.stderr)
        return 2
    from .checkpoint import CheckpointError, lock_output_dir, prepare_output_dir, resolve_output_dir
    from .config import replace
    from .health import TrainingDivergedError

    out = resolve_output_dir(cfg.runner.output_dir)  # once, here: workers are given absolute paths only
    cfg = replace(cfg, runner=replace(cfg.runner, output_dir=str(out)))
    try:
        # held from before the checks to the end of the run (its Runner shares this hold): a second run into `out`
        # fails here, before it removes (--overwrite) or reads (--resume) anything of the run that is writing there
        with lock_output_dir(out, resume=args.resume):
            # before torch and Ray are even imported: refuse to clobber a run, check what --resume will load. What
            # --overwrite removes, it removes once the config's checks on the built task passed (the Runner's, at
            # its start): a typo in the command must not cost the earlier run
            resume_from = None if args.overwrite else prepare_output_dir(out, resume=args.resume, overwrite=False)
            from .runner import run

            history = run(cfg, resume_from=resume_from, overwrite=args.overwrite, progress=not args.no_progress)
    except (CheckpointError, ConfigError) as e:  # ConfigError: a check on the built task (pipelines.taskspec)
        print(f"orchestra train: {e}", file=sys.stderr)
        return 2
    except TrainingDivergedError as e:
        # the run stopped itself (pipelines.health): a training outcome, not a bug; its message names step and metric
        print(f"orchestra train: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        from orchestra import WorkerDiedError

        from .runner import RunInterrupted  # (imported with run(): torch stays out of the checks before it)

        if isinstance(e, RunInterrupted):  # SIGINT / SIGTERM: the run was cancelled and cleaned up
            print(f"orchestra train: {e}", file=sys.stderr)
            _exit_now(e.exit_code)
        if not isinstance(e, WorkerDiedError):
            raise
        if e.declared:  # a rank made unusable by an error in an endpoint (engines: inside a collective): not retried
            print(f"orchestra train: {e}\n(not retried, as any error raised in an endpoint; fix its cause, then "
                  f"continue with --resume)", file=sys.stderr)
            return 1
        # a worker or node died and runner.max_restarts was used up (or is 0): not a bug, not a user error
        print(f"orchestra train: {e}\n(runner.max_restarts={cfg.runner.max_restarts}; continue with --resume)",
              file=sys.stderr)
        return 1
    if history:
        last = history[-1]
        wrote = [f"metrics in {out}/metrics.jsonl" if cfg.runner.metrics else
                 "runner.metrics=false: this run's steps are not in metrics.jsonl"]
        if cfg.runner.tensorboard:
            wrote.append(f"TensorBoard events in {out}/tensorboard")
        reward = last.get("reward/mean")  # an algorithm of one's own need not log it: the run still succeeded
        said = f"last reward/mean {reward:.3f}" if isinstance(reward, (int, float)) else "no reward/mean logged"
        print(f"done: {len(history)} steps, {said}; {'; '.join(wrote)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
