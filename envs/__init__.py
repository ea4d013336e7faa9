"""Gymnasium environments of autotune; importing this package registers them."""

import gymnasium

ENGINE_BUILD_ID = "autotune/EngineBuild-v0"

if ENGINE_BUILD_ID not in gymnasium.registry:
    # Latency is measured, so equal actions can give different rewards: the checker must not expect determinism.
    gymnasium.register(id=ENGINE_BUILD_ID, entry_point="envs.engine_build:EngineBuildEnv", nondeterministic=True)

__all__ = ["ENGINE_BUILD_ID"]
