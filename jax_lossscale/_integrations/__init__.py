"""The frameworks and formats the scaler meets.

* :mod:`._flax`: ``jax_lossscale.flax``'s ``TrainState`` and ``value_and_grad``;
* :mod:`._torch_interop`: ``GradScaler.state_dict()`` both ways;
* :mod:`._checkpoint`: the scaler's config in Orbax checkpoint metadata.
"""
