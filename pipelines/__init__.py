"""pipelines: RL algorithms (GAE, GRPO, KL, PPO losses), the GRPO and PPO steps, the runner, data, config, CLI.

Import what you need from its module (``pipelines.runner.Runner``, ``pipelines.config.load_config``,
``pipelines.algorithms``); this package imports nothing at load time so that workers unpickling a loss stay light.
"""
