"""The float16 demo (examples/demo_fp16.py): a tiny run end to end, and its flags."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEMO = ROOT / "examples" / "demo_fp16.py"
RUNS = ("float32", "float16", "float16 + scaling")

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")


def _load_demo():
  spec = importlib.util.spec_from_file_location("demo_fp16", DEMO)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  out = tmp_path_factory.mktemp("demo") / "out"  # does not exist yet: the demo creates it
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
  # Not strict dtype promotion: optax.adam's bias correction (float ** int32) is not.
  env.pop("JAX_NUMPY_DTYPE_PROMOTION", None)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)
  cmd = [
    sys.executable,
    str(DEMO),
    "--out",
    str(out),
    "--steps",
    "60",
    "--probes",
    "4",
    "--batch-size",
    "256",
    "--hidden",
    "16",
    "--depth",
    "2",
    "--growth-interval",
    "5",
    "--lr",
    "1e-2",
    "--seed",
    "3",
    "--seeds",
    "2",
    "--no-progress",
  ]
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
  assert proc.returncode == 0, proc.stderr[-4000:]
  with open(out / "demo_fp16.json") as f:
    report = json.load(f)
  return out, proc.stdout, report


@pytest.mark.slow
def test_report_values_are_sane(tiny_run):
  _, _, report = tiny_run
  assert report["config"]["steps"] == 60
  assert report["train_examples"] + report["test_examples"] == 1797
  assert report["seeds"] == [3, 4]
  assert [(r["seed"], r["run"]) for r in report["runs"]] == [(s, n) for s in (3, 4) for n in RUNS]
  # A seed is the initial parameters and the batch order: the float32 runs of the two seeds differ.
  ref3, ref4 = (r for r in report["runs"] if r["run"] == RUNS[0])
  assert ref3["train_loss"] != ref4["train_loss"]
  for seed in (3, 4):
    _check_one_seed({r["run"]: r for r in report["runs"] if r["seed"] == seed})


@pytest.mark.slow
def test_summary_is_mean_and_range_over_the_seeds(tiny_run):
  _, _, report = tiny_run
  assert [s["run"] for s in report["summary"]] == list(RUNS)
  for s in report["summary"]:
    rows = [r for r in report["runs"] if r["run"] == s["run"]]
    assert s["seeds"] == 2
    for key in ("test_accuracy", "test_loss", "train_loss", "skipped_steps"):
      values = [r[key] for r in rows]
      assert s[key] == {"mean": sum(values) / 2, "min": min(values), "max": max(values)}, key
    if s["run"] == RUNS[0]:
      assert s["underflow_activations_last_half"] is None
    else:
      values = [r["underflow_activations_last_half"] for r in rows]
      assert s["underflow_activations_last_half"]["max"] == max(values)


def _check_one_seed(runs):
  assert tuple(runs) == RUNS
  for name, r in runs.items():
    for key in ("train_accuracy", "test_accuracy"):
      assert 0.0 <= r[key] <= 1.0, (name, key, r[key])
    assert r["scale_min"] <= r["scale_final"] <= r["scale_max"]
    assert isinstance(r["skipped_steps"], int) and r["skipped_steps"] >= 0
  # 60 steps of Adam on digits learn something in float32 and with scaling.
  for name in (RUNS[0], RUNS[2]):
    r = runs[name]
    for key in ("train_loss", "test_loss", "final_batch_loss"):
      assert math.isfinite(r[key]) and r[key] > 0, (name, key, r[key])
    assert r["train_accuracy"] > 0.5, r
  # The float32 reference and the unscaled run have scale 1 throughout.
  for name in RUNS[:2]:
    r = runs[name]
    assert r["scale_final"] == r["scale_min"] == r["scale_max"] == 1.0
    assert r["skipped_steps"] == 0
  assert runs[RUNS[2]]["scale_max"] > 1.0  # grows with --growth-interval 5
  assert runs[RUNS[0]]["compute_dtype"] == "float32"
  assert runs[RUNS[1]]["compute_dtype"] == runs[RUNS[2]]["compute_dtype"] == "float16"
  # Underflow: not measured for the reference; fractions in [0, 1]; scaling
  # never loses more than no scaling.
  assert runs[RUNS[0]]["underflow_params_mean"] is None
  for kind in ("params", "activations"):
    fractions = {}
    for name in RUNS[1:]:
      r = runs[name]
      assert r["underflow_probes"] >= 1
      for stat in ("mean", "last_half", "max"):
        assert 0.0 <= r[f"underflow_{kind}_{stat}"] <= 1.0
      fractions[name] = r[f"underflow_{kind}_mean"]
    assert fractions[RUNS[2]] <= fractions[RUNS[1]], (kind, fractions)
  # Without scaling float16 flushes per-example activation gradients to zero
  # even in this tiny run; with a scale of 2**16 and more far fewer.
  assert runs[RUNS[1]]["underflow_activations_max"] > 0.0


@pytest.mark.slow
def test_table_printed_and_written(tiny_run):
  out, stdout, report = tiny_run
  table = (out / "demo_fp16.md").read_text()
  assert table.strip() in stdout
  header = next(line for line in table.splitlines() if line.startswith("| run |"))
  # The evidence (gradients flushed) leads; quality follows with its spread.
  assert header.index("activation grads flushed to 0") < header.index("test acc")
  for s in report["summary"]:
    acc = s["test_accuracy"]
    assert f"| {acc['mean']:.4f} ({acc['min']:.4f}..{acc['max']:.4f}) |" in table, s["run"]
  assert report["headline"] in table
  assert report["headline"].startswith("Gradients: without scaling float16 flushes ")


@pytest.mark.slow
def test_png_written(tiny_run):
  out, stdout, _ = tiny_run
  png = out / "demo_fp16.png"
  data = png.read_bytes()
  assert data[:8] == b"\x89PNG\r\n\x1a\n"
  assert len(data) > 10_000  # three panels with curves, not an empty canvas
  assert str(png) in stdout


@pytest.mark.parametrize(
  "argv, message",
  [
    (["--steps", "0"], "--steps must be >= 1"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--steps", "ten"], "--steps must be an integer"),
    (["--lr", "-1"], "--lr must be positive"),
    (["--lr", "nan"], "--lr must be positive"),
    (["--hidden", "0"], "--hidden must be >= 1"),
    (["--batch-size", "5000"], "--batch-size: must be <="),
    (["--param-dtype", "bfloat16"], "invalid choice: 'bfloat16'"),
    (["--test-fraction", "0.95"], "--test-fraction must be positive and <= 0.9"),
  ],
)
def test_bad_flags_are_clear_errors(argv, message, capsys):
  demo = _load_demo()
  with pytest.raises(SystemExit) as err:
    demo.parse_args(argv)
  assert err.value.code == 2
  assert message in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path, capsys):
  demo = _load_demo()
  not_a_folder = tmp_path / "file"
  not_a_folder.write_text("x")
  with pytest.raises(SystemExit):
    demo.parse_args(["--out", str(not_a_folder)])
  assert "is not a folder" in capsys.readouterr().err
  args = demo.parse_args(["--out", str(tmp_path / "new"), "--steps", "3", "--probes", "10"])
  assert args.probes == 3 and args.steps == 3


def _stat(lo, hi):
  return {"mean": (lo + hi) / 2, "min": lo, "max": hi}


def _summary(ref_acc, half_acc, half_loss):
  """float32, float16 and scaled summaries: the scaled run equals float32."""

  def run(name, acc, loss, flushed):
    return {
      "run": name,
      "seeds": 3,
      "test_accuracy": _stat(*acc),
      "test_loss": _stat(*loss),
      "train_loss": _stat(*loss),
      "underflow_activations_last_half": None if flushed is None else _stat(flushed, flushed),
    }

  return [
    run(RUNS[0], ref_acc, (0.10, 0.12), None),
    run(RUNS[1], half_acc, half_loss, 0.9),
    run(RUNS[2], ref_acc, (0.10, 0.12), 0.02),
  ]


def test_compare_uses_the_seed_ranges():
  demo = _load_demo()
  ref, half, _ = _summary((0.96, 0.97), (0.965, 0.98), (0.11, 0.13))
  assert demo.compare(half, ref) == {
    "worse": [],
    "better": [],
    "equal": ["test_accuracy", "test_loss", "train_loss"],
  }
  ref, half, _ = _summary((0.96, 0.97), (0.90, 0.95), (0.13, 0.15))
  assert demo.compare(half, ref) == {
    "worse": ["test_accuracy", "test_loss", "train_loss"],
    "better": [],
    "equal": [],
  }
  ref, half, _ = _summary((0.96, 0.97), (0.975, 0.98), (0.05, 0.09))
  assert demo.compare(half, ref)["better"] == ["test_accuracy", "test_loss", "train_loss"]


def test_headline_says_equal_within_noise_or_worse():
  demo = _load_demo()
  lines = demo.headline(_summary((0.96, 0.97), (0.965, 0.98), (0.11, 0.13))).splitlines()
  assert lines[0] == (
    "Gradients: without scaling float16 flushes 90% of the activation gradients to 0 "
    "(second half of training, mean of 3 seeds); with dynamic_loss_scale 2%."
  )
  assert lines[1] == (
    "Quality, float16 against float32: test accuracy, test loss, train loss equal within "
    "the spread (3 seeds, min..max ranges)."
  )
  assert "benchmarks/results/two-models.md" in lines[3]
  assert (ROOT / "benchmarks" / "results" / "two-models.md").is_file()
  lines = demo.headline(_summary((0.96, 0.97), (0.965, 0.98), (0.13, 0.15))).splitlines()
  assert lines[1] == (
    "Quality, float16 against float32: test loss, train loss worse beyond the seed-to-seed "
    "spread; test accuracy equal within the spread (3 seeds, min..max ranges)."
  )
