"""The benchmarks page's plots: drawn from the committed results, reproducibly, and all present.

``benchmarks/plots.py`` draws ``docs/assets/benchmarks/*.png`` from ``benchmarks/results/*.json``.
These tests check the figures it plots against the JSON files, that two renderings are the same
bytes, that the committed images are what the script draws now (with the matplotlib that drew
them), and that every image ``docs/benchmarks.md`` shows exists.
"""

import pathlib
import re

from helpers import load_benchmark_module
import pytest

pytest.importorskip("matplotlib")
plots = load_benchmark_module("plots")

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "benchmarks.md"
COMMITTED = ROOT / "docs" / "assets" / "benchmarks"


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
  return plots.render(tmp_path_factory.mktemp("plots"))


def test_the_cpu_plot_reads_each_scaler_s_median_ratio():
  ratios = plots.cpu_ratios(plots.load("bench.json"))
  assert list(ratios) == ["mlp-1m", "deep-1m", "mlp-30m", "deep-30m", "transformer", "gpt"]
  assert list(ratios["mlp-1m"]) == list(plots.CPU_VARIANTS)
  assert ratios["mlp-1m"]["jax_lossscale"] == pytest.approx(1.6247630302700002, abs=0)
  assert ratios["deep-30m"]["jmp"] == pytest.approx(2.0, abs=0.005)
  quick = plots.cpu_ratios(plots.load("bench-quick.json"))
  assert "jmp" not in quick["deep-1m"]  # not run there: no bar, not a zero-length one by mistake
  assert quick["rope-gpt"]["jax_lossscale"] == pytest.approx(0.97, abs=0.005)


def test_the_gpu_plot_puts_the_measured_ratio_beside_the_prediction():
  ratios = plots.gpu_ratios()
  assert list(ratios) == list(plots.GPU_VARIANTS)
  median, low, high, predicted = ratios["dynamic_loss_scale"]
  assert (median, low, high) == pytest.approx((1.0244183723300901, 1.0216132296608693, 1.02700643))
  assert predicted == pytest.approx((1.0018399318730324, 1.0020856131978153))
  assert ratios["autocast_dynamic_loss_scale"][3] == pytest.approx((0.9609, 0.9655), abs=1e-4)
  # The scaler against a static scale (second run): per-round median, predicted as the plan's scaler.
  static = ratios["static_scale"]
  assert static[:3] == pytest.approx((1.0014, 0.9748, 1.0111), abs=1e-4)
  assert static[3] == predicted
  assert ratios["torch_compile"][3] is None  # torch is measured only
  assert ratios["torch_compile"][0] == pytest.approx(0.899, abs=5e-4)


def test_two_renderings_are_the_same_bytes(rendered, tmp_path):
  first = rendered
  second = plots.render(tmp_path)
  assert [p.name for p in first] == [p.name for p in second]
  for a, b in zip(first, second):
    assert a.read_bytes() == b.read_bytes(), a.name


def test_the_committed_images_are_what_the_script_draws(rendered):
  paths = rendered
  assert sorted(p.name for p in COMMITTED.glob("*.png")) == sorted(p.name for p in paths)
  stamp = f"matplotlib {plots.matplotlib.__version__}".encode()
  drawn_by = {p.name: b"Software\x00" + stamp in (COMMITTED / p.name).read_bytes() for p in paths}
  if not all(drawn_by.values()):
    pytest.skip(f"the committed images were drawn by another matplotlib than {stamp.decode()}")
  for path in paths:
    assert path.read_bytes() == (COMMITTED / path.name).read_bytes(), (
      f"{path.name}: run `python benchmarks/plots.py` and commit the images"
    )


def test_every_image_on_the_page_exists():
  images = re.findall(r"!\[[^\]]*\]\(([^)]+\.png)\)", PAGE.read_text())
  assert "assets/benchmarks/step-ratio-cpu.png" in images
  assert "assets/benchmarks/gpu-measured-vs-predicted.png" in images
  assert "assets/demo_fp16.png" in images
  for image in images:
    # docs/assets/ is the site's; the demo's picture is added from examples/assets/ (docs/hooks.py).
    candidates = [ROOT / "docs" / image, ROOT / "examples" / image]
    assert any(c.is_file() for c in candidates), image
