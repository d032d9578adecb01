"""The RL algorithms as objects: each in its own file behind :class:`algorithms.base.Algorithm`,
found by name in :data:`algorithms.registry.ALGORITHMS`."""
