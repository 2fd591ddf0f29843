"""Roles mapped to pools: which worker groups a training job runs, and where.

colocated: actor + rollout + reference in one process per rank (critic too, for PPO), reward (+ advantage
helpers) on a CPU pool. split: the rollout engine gets a pool of its own and receives weights worker to worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from orchestra import ResourcePool, WorkerGroup

from .config import (ActorConfig, Config, ConfigError, CriticConfig, kv_heads, model_dir, model_positions,
                     optimizer_steps, read_model_config)
from .join import join
from .taskspec import TaskSpec, longest_prompt
from .advantage_worker import AdvantageWorker

__all__ = ["Cluster", "build_cluster", "capacity_problems", "check_model_fits", "engine_config", "model_overrides",
           "optimizer_steps", "wait_for_capacity"]

log = logging.getLogger("orchestra")


def model_overrides(cfg: Config, vocab_size: int) -> dict[str, Any]:
    """Overrides of the tiny Qwen2 config built from the ``model`` section."""
    m = cfg.model
    return {"vocab_size": m.vocab_size or vocab_size, "hidden_size": m.hidden_size, "num_hidden_layers": m.num_layers,
            "num_attention_heads": m.num_heads, "num_key_value_heads": kv_heads(m),
            "intermediate_size": m.intermediate_size or 2 * m.hidden_size, "max_position_embeddings": m.max_seq_len,
            "tie_word_embeddings": m.tie_embeddings}


def check_model_fits(cfg: Config, task: TaskSpec) -> None:
    """The model takes the task's tokens, before any worker starts: its vocabulary covers the task tokenizer's ids
    (an id past the embedding fails inside the workers), and with ``model.path`` the longest prompt plus
    ``rollout.max_new_tokens`` fits its positions (the tiny model's ``model.max_seq_len`` is checked by the task).
    Raises :class:`ConfigError` naming the key to change."""
    tok = task.tokenizer()
    m = cfg.model
    if m.path is None:
        if m.vocab_size is not None and m.vocab_size < tok.vocab_size:
            raise ConfigError(
                f"model.vocab_size: bad value {m.vocab_size}; the task's tokenizer has {tok.vocab_size} token ids, "
                f"all of which the model must embed: raise it to {tok.vocab_size} or more (or remove it: null takes "
                "the tokenizer's)", "model.vocab_size")
        return
    hf = read_model_config(m.path)
    vocab = hf.get("vocab_size")
    if not isinstance(vocab, int) or isinstance(vocab, bool) or vocab < tok.vocab_size:
        raise ConfigError(
            f"model.path: {m.path} has vocab_size {vocab!r} in its config.json; the task's tokenizer has "
            f"{tok.vocab_size} token ids, all of which the model must embed: use a model over the task's tokenizer",
            "model.path")
    positions = model_positions(hf)
    longest = longest_prompt(cfg, task)
    if longest + cfg.rollout.max_new_tokens > positions:
        raise ConfigError(
            f"rollout.max_new_tokens: bad value {cfg.rollout.max_new_tokens}; the task's longest prompt is {longest} "
            f"tokens (bos included), and model.path's config.json has max_position_embeddings {positions}: lower "
            f"rollout.max_new_tokens to {positions - longest} or less (or shorten the prompts)",
            "rollout.max_new_tokens")


def engine_config(cfg: Config, section: ActorConfig | CriticConfig, total_steps: int, seed: int,
                  schedule_start: int = 0) -> Any:
    """An ``engines.EngineConfig`` from the actor's or the critic's own section (every knob explicit);
    ``schedule_start``: optimizer steps before the LR schedule starts (the task's warm start)."""
    from engines import EngineConfig

    return EngineConfig(lr=section.lr, weight_decay=section.weight_decay, warmup_steps=section.warmup_steps,
                        lr_schedule=section.lr_schedule, min_lr_ratio=section.min_lr_ratio,
                        betas=(0.9, section.beta2), total_steps=total_steps, grad_clip=section.grad_clip,
                        micro_batch_size=section.micro_batch_size, seed=seed, schedule_start=schedule_start,
                        device="cuda" if cfg.resources.device == "cuda" else "cpu")


@dataclass
class Cluster:
    """The job's worker groups. ``rollout`` is ``actor`` when colocated; ``critic`` only for PPO."""

    actor: WorkerGroup
    rollout: WorkerGroup
    reward: WorkerGroup
    advantage: WorkerGroup
    critic: WorkerGroup | None = None
    pools: list[ResourcePool] = field(default_factory=list)

    @property
    def split(self) -> bool:
        return self.rollout is not self.actor

    def groups(self) -> list[WorkerGroup]:
        out = [self.actor, self.reward, self.advantage]
        if self.split:
            out.append(self.rollout)
        if self.critic is not None:
            out.append(self.critic)
        return out

    async def ready(self) -> None:
        await join(*[g.ready() for g in self.groups()])

    def shutdown(self) -> None:
        seen = set()
        for g in self.groups():
            if id(g._shared) not in seen:
                seen.add(id(g._shared))
                g.shutdown()

    async def aclose(self) -> None:
        """Close every group (calls in flight fail with ``GroupClosedError``; actors killed, pools released).
        Safe after a rank died and safe to call twice: that is how a restart tears the job down."""
        for g in self.groups():
            await g.aclose()


def capacity_problems(pools: list[ResourcePool]) -> list[str]:
    """Why ``pools`` (all of them at once) cannot fit the live nodes of the Ray cluster now; empty when they fit.
    Counts node totals, not what is free: a restart asks this right after closing the old groups, whose
    resources Ray frees asynchronously (placement then waits for them). In-process pools (``resources.backend=
    local``) take no node capacity and are not counted: a job of only those needs no Ray cluster."""
    import ray

    pools = [p for p in pools if p.backend.own_process]
    if not pools:
        return []
    nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
    total: dict[str, float] = {}
    for t in nodes:
        for k, v in t.items():
            total[k] = total.get(k, 0.0) + v
    need: dict[str, float] = {}
    problems = []
    for pool in pools:
        bundle = pool.bundle()
        for k, v in bundle.items():
            need[k] = need.get(k, 0.0) + v * pool.world_size
        for i, count in enumerate(pool.process_on_nodes):
            entry = {k: v * count for k, v in bundle.items()}
            if not any(all(t.get(k, 0.0) + 1e-9 >= v for k, v in entry.items()) for t in nodes):
                problems.append(f"pool {pool.name!r} entry {i} needs {entry} on one node; no live node has it")
    problems += [f"{k}: the pools need {v:g}, the live nodes have {total.get(k, 0.0):g}"
                 for k, v in need.items() if total.get(k, 0.0) + 1e-9 < v]
    return problems


async def wait_for_capacity(pools: list[ResourcePool], timeout_s: float, poll_s: float = 0.5) -> None:
    """Wait until ``pools`` fit the live nodes again (a lost node's capacity came back), at most ``timeout_s``;
    then :class:`orchestra.PlacementError` saying what is missing."""
    import anyio

    from orchestra import PlacementError

    problems = await anyio.to_thread.run_sync(capacity_problems, pools)
    if not problems:
        return
    log.warning("waiting up to %g s for the cluster to fit the job again: %s", timeout_s, "; ".join(problems))
    with anyio.move_on_after(timeout_s):
        while problems:
            await anyio.sleep(poll_s)
            problems = await anyio.to_thread.run_sync(capacity_problems, pools)
        return
    raise PlacementError(f"the cluster did not fit the job's pools again within runner.restart_timeout_s="
                         f"{timeout_s:g} s:\n  - " + "\n  - ".join(problems))


def build_cluster(cfg: Config, task: TaskSpec) -> Cluster:
    """Start the job's groups (in the background; ``await cluster.ready()``)."""
    from engines import SamplingParams
    from engines.workers import ActorRolloutRefWorker, CriticWorker, RewardWorker

    r = cfg.resources
    tok = task.tokenizer()
    # model.path: every role loads that directory, given as an absolute path (workers on Ray run in a copy of the
    # driver's working directory); else the tiny random Qwen2 from the model section's knobs
    path = None if cfg.model.path is None else str(model_dir(cfg.model.path))
    model = None if path is not None else model_overrides(cfg, tok.vocab_size)
    total = optimizer_steps(cfg, cfg.actor)
    seed = cfg.runner.seed
    sampling = SamplingParams(n=cfg.rollout.n, max_new_tokens=cfg.rollout.max_new_tokens,
                              temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)
    use_gpu = r.device == "cuda"
    actor_pool = ResourcePool(process_on_nodes=[r.actor_workers], use_gpu=use_gpu, name="actor", backend=r.backend)
    actor_engine = engine_config(cfg, cfg.actor, total, seed, schedule_start=task.warm_start_steps)
    actor_init = dict(model=model, model_path=path, seed=seed, engine=actor_engine, sampling=sampling, tokenizer=tok,
                      with_ref=cfg.algorithm.kl_coef > 0)
    roles: dict[str, type] = {"actor": ActorRolloutRefWorker}
    init: dict[str, dict] = {"actor": actor_init}
    if cfg.algorithm.name == "ppo":
        roles["critic"] = CriticWorker
        init["critic"] = dict(model=model, model_path=path, seed=seed + 1,
                              engine=engine_config(cfg, cfg.critic, optimizer_steps(cfg, cfg.critic), seed + 1))
    views = WorkerGroup.colocate(actor_pool, roles, group_name="actor", **init)
    pools = [actor_pool]
    rollout = views["actor"]
    if r.placement == "split":
        from engines.rollout_worker import RolloutWorker

        rollout_pool = ResourcePool(process_on_nodes=[r.rollout_workers], use_gpu=use_gpu, name="rollout",
                                    backend=r.backend)
        rollout = WorkerGroup(rollout_pool, RolloutWorker, model=model, model_path=path, seed=seed, sampling=sampling,
                              tokenizer=tok, group_name="rollout")
        pools.append(rollout_pool)
    reward_pool = ResourcePool(process_on_nodes=[r.reward_workers], name="reward", backend=r.backend)
    reward_views = WorkerGroup.colocate(reward_pool, {"reward": RewardWorker, "advantage": AdvantageWorker},
                                       group_name="reward",
                                       reward=dict(reward=task.reward_fn, tokenizer=tok, task=task.name,
                                                   **task.reward_kwargs))
    pools.append(reward_pool)
    return Cluster(actor=views["actor"], rollout=rollout, reward=reward_views["reward"],
                   advantage=reward_views["advantage"], critic=views.get("critic"), pools=pools)
