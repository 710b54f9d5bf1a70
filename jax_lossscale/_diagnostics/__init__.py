"""Diagnostics: the in-step gradient statistics and the one-off underflow check.

* :mod:`._stats`: :func:`grad_diagnostics`, :class:`GradDiagnostics`, :func:`grad_leaf_names`;
* :mod:`._underflow`: :func:`check_underflow`, :class:`UnderflowReport`;
* :mod:`._taps`: the gradient taps it passes to the autocast interpreter.

The public namespace is :mod:`jax_lossscale.diagnostics`.
"""
