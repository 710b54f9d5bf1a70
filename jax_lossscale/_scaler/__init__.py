"""The scaler's core: torch's ``GradScaler`` as an Optax gradient transformation.

* :mod:`._state`: ``DynamicScaleConfig``, ``DynamicScaleState``, the one resolver of a
  scale (``scale_of``) and of a scaler state (``get_scale_state``);
* :mod:`._find`: the one walk that finds the scaler's state (or any node of a kind) in a
  pytree;
* :mod:`._rule`: the scale update rule (``update_scale``);
* :mod:`._product`, :mod:`._numerics`: the exact products and reciprocals, unscaling and
  the finiteness check;
* :mod:`._skip`: the one skip (``jnp.where``, copy-free on CPU);
* :mod:`._fp8`: Flax's fp8 meta-state, which is never a gradient (spelled here, without
  Flax, so that every entry point leaves it out);
* :mod:`._transform`: ``dynamic_loss_scale``, ``static_loss_scale``, ``no_loss_scale``;
* :mod:`._loss`: ``scale_loss``, and the one reader of a loss function's ``has_aux``
  output (``loss_and_aux``);
* :mod:`._accumulation`: ``multi_steps``;
* :mod:`._sharding`: one decision across devices and placement on the params' mesh;
* :mod:`._guard`, :mod:`._metrics`, :mod:`._signals`: host-side guards, step metrics and
  the trace-time warnings.
"""
