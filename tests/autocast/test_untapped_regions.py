"""check_underflow inside the regions it counts instead of tapping (a cond, a while, a custom rule).

Inside such a region the interpreter counts each lower-precision output (a tap there would sum
the gradients of every branch or iteration). What it counts must not disturb what it taps: a
scan inside a cond takes no scan number from the tapped scans (their tap names are stable), and
an op whose outputs hold no float is counted as nothing.
"""

from helpers import not_checked
from helpers import rand
from jax import lax
import jax.numpy as jnp

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow

F32 = jnp.float32


def test_a_scan_inside_a_cond_takes_no_number_from_the_tapped_scans():
  w, x = rand(0, (4, 4)), rand(1, (3, 8, 4))

  def loss(w, x):
    counted = lambda: lax.scan(lambda c, xt: (c, xt @ w), 0.0, x)[1]
    h = lax.cond(x[0, 0, 0] > 0, counted, counted)
    ys = lax.scan(lambda c, xt: (c, jnp.tanh(xt @ w)), 0.0, x)[1]
    return jnp.sum(h.astype(F32)) + jnp.sum(ys.astype(F32))

  report = check_underflow(jls.autocast(loss), w, x)
  # the tapped scan is the first one tapped: scan#0, one tap per iteration
  assert sorted(report.looked_at()["activations"]) == [
    f"activations/scan#0[{i}]/dot_general#0" for i in range(3)
  ]
  assert not_checked(report) == {"cond": (1, 2)}  # each branch's matmul, counted


def test_an_integer_matmul_inside_a_cond_is_counted_as_nothing():
  w, x, n = rand(0, (4, 4)), rand(1, (8, 4)), jnp.ones((4, 4), jnp.int32)

  def loss(w, xn):
    x, n = xn
    m = lax.cond(n[0, 0] > 0, lambda: n @ n, lambda: n)  # lowered, but no float output
    return jnp.sum((x @ w).astype(F32)) + jnp.sum(m).astype(F32)

  report = check_underflow(jls.autocast(loss), w, (x, n))
  assert sorted(report.looked_at()["activations"]) == ["activations/dot_general#0"]
  assert not_checked(report) == {}
