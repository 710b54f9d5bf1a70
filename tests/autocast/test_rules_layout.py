"""autocast's layout rules (``_rules/_layout.py``): a layout primitive takes no rule of the
policy; it follows its operand.
"""

import jax.numpy as jnp
import pytest

from jax_lossscale._autocast import autocast


def test_a_layout_primitive_takes_no_rule():
  # convert_element_type moves a value between dtypes as the model wrote it: it has no
  # rule of its own to override.
  with pytest.raises(ValueError, match=r"policy\['convert_element_type'\].*layout primitive"):
    autocast(jnp.exp, policy={"convert_element_type": "lower"})
