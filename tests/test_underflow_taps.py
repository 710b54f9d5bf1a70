"""check_underflow's automatic taps of an autocast function (issue 33).

* batched and einsum attention, and a vmapped MLP followed by a matmul, are tapped (each
  tap's value went to another tap: the values were matched by sorted name, not by name);
* the verdict names what it did not look at (the ops inside ``while`` loops, conds, custom
  rules);
* a user's tap on a tapped output counts once;
* each tap's fraction is the direct measurement: the float16 gradient of that output
  against the float32 one.
"""

import dataclasses

import jax
from jax import lax
import jax.numpy as jnp
import pytest

import jax_lossscale as jls
from jax_lossscale.diagnostics import check_underflow


def _rand(key, shape, scale=1.0):
  return scale * jax.random.normal(jax.random.key(key), shape, jnp.float32)


def test_einsum_attention_scores_are_tapped_with_their_own_shapes():
  w, x = _rand(0, (8, 8)), _rand(1, (3, 5, 8))
  f = jls.autocast(lambda w, x: 1e-6 * jnp.sum(jnp.einsum("btd,bsd->bts", x @ w, x @ w)))
  report = check_underflow(f, w, x)
  acts = report.looked_at()["activations"]
  assert len(acts) == 3, acts
  assert sorted(int(report.nonzero[k]) for k in acts) == [3 * 5 * 5, 3 * 5 * 8, 3 * 5 * 8]


def test_a_vmapped_mlp_followed_by_a_matmul_is_tapped():
  w1, w2, w3 = _rand(0, (8, 16)), _rand(1, (16, 8)), _rand(2, (8, 4))
  x = _rand(3, (6, 8))

  def loss(p, x):
    h = jax.vmap(lambda t: jax.nn.gelu(t @ p[0]) @ p[1])(x)
    return 1e-7 * jnp.sum(h @ p[2])

  report = check_underflow(jls.autocast(loss), (w1, w2, w3), x)
  acts = report.looked_at()["activations"]
  assert len(acts) == 3, acts
  # each tap has the gradient of its own output (the gelu's flat tail is exactly 0)
  nonzero = sorted(int(report.nonzero[k]) for k in acts)
  assert nonzero[:2] == [6 * 4, 6 * 8] and 0 < nonzero[2] <= 6 * 16, nonzero


@jax.custom_vjp
def _two_matmuls(h, w):
  """A custom rule around two matmuls (its rule's own backward: the plain one)."""
  return jnp.tanh(h @ w) @ w


_two_matmuls.defvjp(
  lambda h, w: jax.vjp(lambda h, w: jnp.tanh(h @ w) @ w, h, w),
  lambda vjp, g: vjp(g),
)


def test_the_verdict_names_the_ops_inside_a_custom_rule_it_did_not_tap():
  w, x = _rand(0, (8, 8), 0.3), _rand(1, (12, 4, 8))

  def loss(w, xs):
    return 1e-6 * jnp.sum(_two_matmuls(xs, w) @ w)

  report = check_underflow(jls.autocast(loss), w, x)
  assert {k: tuple(int(v) for v in n) for k, n in report.not_checked.items()} == {
    "custom_vjp_call": (1, 2)
  }
  verdict = report.verdict()
  assert "not checked: the 2 lower-precision op outputs inside 1 custom_vjp_call" in verdict
  # the matmul after the custom rule is tapped
  assert len(report.looked_at()["activations"]) == 1


def test_the_verdict_adds_up_the_ops_inside_regions_of_several_kinds():
  w, x = _rand(0, (8, 8), 0.3), _rand(1, (12, 4, 8))

  def loss(w, xs):
    hs = _two_matmuls(xs, w)
    y = lax.cond(xs[0, 0, 0] > 0, lambda: hs[-1] @ w, lambda: (hs[0] @ w) @ w)
    return 1e-6 * jnp.sum(y)

  report = check_underflow(jls.autocast(loss), w, x)
  assert {k: tuple(int(v) for v in n) for k, n in report.not_checked.items()} == {
    "custom_vjp_call": (1, 2),
    "cond": (1, 3),
  }
  verdict = report.verdict()
  assert "not checked: the 5 lower-precision op outputs inside 1 cond, 1 custom_vjp_call" in (
    verdict
  )


def test_a_function_without_loops_says_nothing_was_left_out():
  w, x = _rand(0, (8, 8)), _rand(1, (4, 8))
  report = check_underflow(jls.autocast(lambda w, x: jnp.sum(x @ w)), w, x)
  assert report.not_checked == {}
  assert "not checked" not in report.verdict()


@pytest.mark.parametrize("bias", [False, True])
def test_a_users_tap_on_a_tapped_output_counts_once(bias):
  w, b, x = _rand(0, (8, 4)), _rand(1, (4,)), _rand(2, (6, 8))

  def loss(p, x, taps):
    logits = x @ p["w"] + p["b"] if bias else x @ p["w"]
    logits = logits + taps["logits"]
    return 1e-6 * jnp.sum(logits)

  report = check_underflow(
    jls.autocast(loss), {"w": w, "b": b}, x, activations={"logits": jnp.zeros((6, 4))}
  )
  assert report.looked_at()["activations"] == ["activations/logits"]
  assert "(1 leaves;" in report.verdict().split("activation-gradient")[1]


def test_a_users_tap_elsewhere_keeps_the_automatic_taps():
  w, x = _rand(0, (8, 8)), _rand(1, (6, 8))

  def loss(w, x, taps):
    h = jnp.tanh(x @ w) + taps["h"]
    return jnp.sum(h @ w)

  report = check_underflow(jls.autocast(loss), w, x, activations={"h": jnp.zeros((6, 8))})
  assert len(report.looked_at()["activations"]) == 3


def test_a_float32_tap_inside_an_autocast_function_of_a_dtype_parameterised_loss_is_refused():
  # issue 33: the tap promoted the float16 activation, and the check measured the float32
  # gradient ("does not need loss scaling: 0.00%" while half of it flushed).
  x = jnp.ones((8, 2))
  c = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
  w = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]])}

  def loss(p, batch, dtype, taps):
    def f(p, x, taps):
      return jnp.sum((x @ p["w"] + taps["logits"]) * c)

    return jls.autocast(f, dtype)(p, batch, taps)

  with pytest.raises(ValueError, match="activations: the tap 'logits' is added in float32") as e:
    check_underflow(loss, w, x, activations={"logits": jnp.zeros((8, 2))})
  # the one fix that works inside autocast comes first; no cast to h.dtype (float32 there)
  assert "is added in float32 to a float16 activation made float32 for it" in str(e.value)
  assert "Pass the autocast function itself as loss_fn" in str(e.value)
  assert ".astype(" not in str(e.value)

  def by_hand(p, batch, dtype, taps):  # the same mistake written by hand
    h = (batch.astype(dtype) @ p["w"].astype(dtype)).astype(jnp.float32)
    return jnp.sum((h + taps["logits"]) * c)

  with pytest.raises(ValueError, match="the tap 'logits'") as e:
    check_underflow(by_hand, w, x, activations={"logits": jnp.zeros((8, 2))})
  assert "(h + taps[...].astype(dtype), dtype the loss_fn's argument, here float16)" in str(e.value)

  def right(p, batch, dtype, taps):  # the tap cast to the activation's dtype
    h = batch.astype(dtype) @ p["w"].astype(dtype) + taps["logits"].astype(dtype)
    return jnp.sum(h.astype(jnp.float32) * c)

  r = check_underflow(right, w, x, activations={"logits": jnp.zeros((8, 2))})
  assert r.fractions()["activations/logits"] == 0.5


def test_leaf_names_through_an_equinox_partial_are_the_users():
  eqx = pytest.importorskip("equinox")
  from jax_lossscale.diagnostics import grad_leaf_names

  lin = eqx.nn.Linear(2, 3, key=jax.random.key(0))
  params = {"head": eqx.Partial(lin), "loss": eqx.Partial(lambda x, w: x @ w, w=jnp.ones(2))}
  # no func/ or keywords/ (and the functions the partials hold are not leaves to name)
  assert grad_leaf_names(params) == ["head/weight", "head/bias", "loss/w"]


def test_leaf_names_through_an_equinox_partial_keep_func_and_keywords_when_they_would_clash():
  eqx = pytest.importorskip("equinox")
  from jax_lossscale.diagnostics import grad_leaf_names

  class Scale(eqx.Module):
    w: jax.Array

  # func/w and keywords/w would both be w: the names keep func/ and keywords/
  p = eqx.Partial(Scale(jnp.ones(2)), w=jnp.ones(3))
  assert grad_leaf_names({"p": p}) == ["p/func/w", "p/keywords/w"]


def test_leaf_names_through_a_jax_partial_are_its_flattening_path():
  from jax_lossscale.diagnostics import grad_leaf_names

  # a jax.tree_util.Partial's leaves are keyed 0 (its args) and 1 (its keywords): kept
  p = jax.tree_util.Partial(lambda x, w: x * w, jnp.ones(2), w=jnp.ones(3))
  assert grad_leaf_names({"p": p}) == ["p/0/0", "p/1/w"]


def test_a_users_module_named_partial_keeps_its_func_name():
  # Only a module of func, args and keywords is taken for an equinox.Partial.
  from jax_lossscale.diagnostics import grad_leaf_names

  @jax.tree_util.register_dataclass
  @dataclasses.dataclass
  class Partial:
    func: jax.Array
    scale: jax.Array

  assert grad_leaf_names({"p": Partial(jnp.ones(2), jnp.ones(3))}) == ["p/func", "p/scale"]


def test_an_op_inside_a_named_scope_is_tapped_under_the_scope():
  w, x = _rand(0, (8, 4)), _rand(1, (6, 8))

  def loss(w, x):
    with jax.named_scope("encoder"):
      h = x @ w
    return 1e-6 * jnp.sum(h @ w.T)

  report = check_underflow(jls.autocast(loss), w, x)
  acts = report.looked_at()["activations"]
  assert sorted(acts) == ["activations/dot_general#1", "activations/encoder/dot_general#0"]
  assert int(report.nonzero["activations/encoder/dot_general#0"]) == 6 * 4


def test_a_registered_lower_precision_op_is_tapped_under_its_name():
  # dot_product_attention is one op (its matmuls are not interpreted): its output is
  # tapped, named for it.
  wq, x = _rand(0, (8, 8)), _rand(1, (2, 4, 1, 8))

  def loss(w, x):
    q = x @ w
    return 1e-6 * jnp.sum(jax.nn.dot_product_attention(q, q, q))

  report = check_underflow(jls.autocast(loss), wq, x)
  acts = report.looked_at()["activations"]
  assert [a.rsplit("/", 1)[-1].split("#")[0] for a in sorted(acts)] == [
    "dot_general",
    "dot_product_attention",
  ]
  assert int(report.nonzero[next(a for a in acts if "dot_product_attention" in a)]) == 2 * 4 * 8


def test_a_float32_tap_in_a_checkpointed_region_is_refused_as_outside_it():
  # The walk for this mistake enters the regions JAX stages a function into: jit, and
  # remat (JAX's `remat2`; the walk looked for `checkpoint`, a name no primitive has).
  x = jnp.ones((8, 2))
  c = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
  w = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]])}

  def region(p, batch, dtype, taps):
    h = (batch.astype(dtype) @ p["w"].astype(dtype)).astype(jnp.float32)
    return jnp.sum((h + taps["logits"]) * c)

  for wrap in (jax.checkpoint, jax.jit):

    def loss(p, batch, dtype, taps, wrap=wrap):
      return wrap(lambda p, b, t: region(p, b, dtype, t))(p, batch, taps)

    with pytest.raises(ValueError, match="the tap 'logits' is added in float32"):
      check_underflow(loss, w, x, activations={"logits": jnp.zeros((8, 2))})


def test_a_float32_tap_cast_to_half_and_back_before_the_add_is_refused():
  # The walk follows the tap through its casts: back in float32, it is the same mistake.
  x = jnp.ones((8, 2))
  c = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
  w = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]])}

  def loss(p, batch, dtype, taps):
    h = (batch.astype(dtype) @ p["w"].astype(dtype)).astype(jnp.float32)
    return jnp.sum((h + taps["logits"].astype(dtype).astype(jnp.float32)) * c)

  with pytest.raises(ValueError, match="the tap 'logits' is added in float32"):
    check_underflow(loss, w, x, activations={"logits": jnp.zeros((8, 2))})


def test_a_float32_param_added_to_a_float32_copy_is_not_taken_for_a_tap():
  # Only the leaves under activations= are taps: a float32 param added after the upcast
  # (of the activation's shape, so added as it is) is the model's own float32 arithmetic.
  x = jnp.ones((8, 2))
  c = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
  p = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]]), "b": jnp.zeros((8, 2))}

  def loss(p, batch, dtype, taps):
    h = batch.astype(dtype) @ p["w"].astype(dtype) + taps["logits"].astype(dtype)
    return jnp.sum((h.astype(jnp.float32) + p["b"]) * c)

  r = check_underflow(loss, p, x, activations={"logits": jnp.zeros((8, 2))})
  assert r.fractions()["activations/logits"] == 0.5
  assert r.fractions(scaled=True)["activations/logits"] == 0.0


def test_a_float32_tap_on_a_float32_value_made_from_integers_is_not_refused():
  # Pixels as uint8, made float32 and tapped there: never half precision, not the mistake.
  pixels = jnp.arange(12, dtype=jnp.uint8).reshape(4, 3)
  w = jnp.ones((3, 2))

  def loss(w, batch, dtype, taps):
    x = batch.astype(jnp.float32) + taps["input"]
    return 1e-3 * jnp.sum((x.astype(dtype) @ w.astype(dtype)).astype(jnp.float32))

  r = check_underflow(loss, w, pixels, activations={"input": jnp.zeros((4, 3))})
  assert r.looked_at() == {"params": ["params"], "activations": ["activations/input"]}
  assert int(r.nonzero["activations/input"]) == 12
  assert r.fractions()["activations/input"] == 0.0


def test_a_float32_tap_inside_params_added_to_a_float32_copy_is_refused():
  # The taps may be passed inside params instead of as activations=: the same mistake.
  x = jnp.ones((8, 2))
  c = jnp.tile(jnp.array([[1e-9], [1e-3]]), (4, 2))
  p = {"w": jnp.asarray([[1.0, -0.5], [0.25, 2.0]]), "activations": {"logits": jnp.zeros((8, 2))}}

  def loss(p, batch, dtype):
    h = (batch.astype(dtype) @ p["w"].astype(dtype)).astype(jnp.float32)
    return jnp.sum((h + p["activations"]["logits"]) * c)

  with pytest.raises(ValueError, match="the tap 'logits' is added in float32 to a float16"):
    check_underflow(loss, p, x)

  def cast_tap(p, batch, dtype):  # the tap in the activation's dtype: measured
    h = batch.astype(dtype) @ p["w"].astype(dtype)
    return jnp.sum((h + p["activations"]["logits"].astype(dtype)).astype(jnp.float32) * c)

  assert check_underflow(cast_tap, p, x).fractions()["activations/logits"] == 0.5
