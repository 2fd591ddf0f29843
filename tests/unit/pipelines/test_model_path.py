"""``model.path``: a Hugging Face model directory every engine role loads (actor, reference, rollout, critic), checked
before the cluster starts; a path that is not one, a response longer than its positions, tiny-model knobs that it
would override, or a ``model.dtype`` the engines do not train in are config errors naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from local_jobs import LOCAL_TINY

import orchestra
from pipelines.cli import main as cli_main
from pipelines.config import ConfigError, load_config

POSITIONS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 over the task's character tokenizer, saved as from_pretrained reads it."""
    from engines.models import build_causal_lm, tiny_qwen2_config
    from engines.tokenizer import CharTokenizer

    d = tmp_path_factory.mktemp("tiny_qwen2")
    config = tiny_qwen2_config(vocab_size=CharTokenizer().vocab_size, hidden_size=32, intermediate_size=48,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               max_position_embeddings=POSITIONS)
    build_causal_lm(config, seed=123).save_pretrained(d)
    return d


def test_a_missing_model_path_is_a_config_error_before_ray(tmp_path, monkeypatch, capsys):
    def refuse(*args, **kwargs):
        raise AssertionError("the cluster was started")

    monkeypatch.setattr(orchestra, "init", refuse)
    code = cli_main(["train", f"model.path={tmp_path / 'nope'}", f"runner.output_dir={tmp_path / 'run'}",
                     "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("orchestra train: model.path: ") and "does not exist" in err
    assert "Traceback" not in err


def test_a_directory_that_is_not_a_hf_model_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(ConfigError, match=r"model.path: .*config\.json"):
        load_config(None, [f"model.path={tmp_path / 'm'}"])
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": 64}))
    with pytest.raises(ConfigError, match=r"model.path: .*no weights"):
        load_config(None, [f"model.path={tmp_path / 'm'}"])


def test_the_response_must_fit_the_models_positions(model_dir):
    with pytest.raises(ConfigError, match=rf"rollout.max_new_tokens: bad value 200.*max_position_embeddings.*"
                                          rf"{POSITIONS}"):
        load_config(None, [f"model.path={model_dir}", "rollout.max_new_tokens=200"])


def test_the_prompt_and_the_response_must_fit_the_models_positions(model_dir, tmp_path):
    from pipelines.runner import Runner

    cfg = load_config(None, [*LOCAL_TINY, f"model.path={model_dir}", "rollout.max_new_tokens=20",
                             f"runner.output_dir={tmp_path}"])
    with pytest.raises(ConfigError, match=r"rollout.max_new_tokens: .*longest prompt.*max_position_embeddings"):
        Runner(cfg, progress=False)


@pytest.mark.parametrize("knob", ["model.hidden_size=32", "model.vocab_size=100", "model.max_seq_len=128"])
def test_tiny_model_knobs_next_to_a_path_are_refused(model_dir, knob):
    with pytest.raises(ConfigError, match=rf"{knob.split('=')[0]}: .*model.path"):
        load_config(None, [f"model.path={model_dir}", knob])


def test_a_dtype_the_engines_do_not_train_in_is_refused():
    with pytest.raises(ConfigError, match=r"model.dtype: bad value 'bfloat16'.*float32"):
        load_config(None, ["model.dtype=bfloat16"])


@pytest.mark.slow  # builds an in-process PPO job (actor, reference, split rollout, critic): ~3 s
async def test_every_role_loads_the_model_at_model_path(model_dir, tmp_path, monkeypatch):
    import engines.models
    from pipelines.cluster import build_cluster
    from pipelines.taskspec import get_task

    built: list[tuple[str, str | None]] = []
    build = engines.models._build

    def spy(auto_cls, config, **kw):
        built.append((auto_cls.__name__, None if kw.get("path") is None else str(kw["path"])))
        return build(auto_cls, config, **kw)

    monkeypatch.setattr(engines.models, "_build", spy)
    cfg = load_config(None, [*LOCAL_TINY, f"model.path={model_dir}", "algorithm.name=ppo", "algorithm.kl_coef=0.01",
                             "resources.placement=split", f"runner.output_dir={tmp_path}"])
    cluster = build_cluster(cfg, get_task(cfg))
    try:
        await cluster.ready()
        weights = await cluster.actor.state_dict_for_sync()
    finally:
        cluster.shutdown()
    # actor, reference and rollout copy (ActorRolloutRefWorker), the split rollout pool, the critic's backbone
    assert sorted(built) == sorted([("AutoModelForCausalLM", str(model_dir))] * 4
                                   + [("AutoModelForTokenClassification", str(model_dir))])
    saved = engines.models.build_causal_lm(path=model_dir).state_dict()
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)
