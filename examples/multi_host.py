"""Many hosts: the same float16 training script in every process of a ``jax.distributed`` run.

JAX's multi-controller runtime runs one copy of this script per host (here:
per process); together the processes see one global set of devices, one
``jax.make_mesh`` over all of them, and ``jit`` computes on arrays that no
single process holds entirely. The loss scaler needs nothing special: the
overflow check of a jitted step sees the *global* gradients, so every device
of every process takes the same skip decision and holds the same scale. Each
process prints its own view: the same loss, scale and skipped steps.

Run it locally, as 2 processes of 4 CPU devices each (it launches its own
workers on 127.0.0.1; cross-process sums go through gloo)::

  python examples/multi_host.py --smoke

On a real cluster, start one copy per host with your launcher and pass
``--cluster``; only the start-up differs, the training code is the same:

* SLURM (``srun python examples/multi_host.py --cluster``), Kubernetes (an
  indexed Job / JobSet), Cloud TPU: ``jax.distributed.initialize()`` with no
  arguments reads the coordinator address, the number of processes and this
  process's id from the environment.
* Elsewhere pass them yourself:
  ``jax.distributed.initialize("HOST0:PORT", num_processes=N, process_id=i)``.
* GPUs: install ``jax[cuda12]``; cross-process collectives use NCCL, and the
  gloo line below (for CPUs only) is not needed. Use float16 compute as here,
  or bfloat16 with ``jls.no_loss_scale``.

Run: python examples/multi_host.py --smoke | --cluster [--steps N]
"""

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jax_lossscale as jls

LOCAL_PROCESSES, LOCAL_DEVICES = 2, 4


def make_data(n, d=16, seed=0):
  """The global dataset; every process loads only its own rows (see ``local_rows``)."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(n, d)).astype(np.float32)
  y = np.tanh(x @ rng.normal(size=(d, 1))).astype(np.float32)
  return x, y


def loss_fn(params, x, y):
  p = jax.tree_util.tree_map(lambda a: a.astype(jnp.float16), params)  # float16 compute
  h = jax.nn.relu(x.astype(jnp.float16) @ p["w1"])
  return jnp.mean(((h @ p["w2"]).astype(jnp.float32) - y) ** 2)


def train(steps):
  """The training code: identical on a laptop and on a cluster."""
  me = jax.process_index()
  mesh = jax.make_mesh((jax.device_count(),), ("data",))  # all devices of all processes
  batch = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  print(
    f"[process {me}] {jax.local_device_count()} of {jax.device_count()} devices "
    f"({jax.devices()[0].platform}), {jax.process_count()} processes",
    flush=True,
  )

  x, y = make_data(n=32 * jax.device_count())
  # Each process reads its own slice of the batch; together they form one global array.
  per_process = len(x) // jax.process_count()
  local_rows = slice(me * per_process, (me + 1) * per_process)
  x = jax.make_array_from_process_local_data(batch, x[local_rows])
  y = jax.make_array_from_process_local_data(batch, y[local_rows])

  with jax.set_mesh(mesh):
    # The same initial params everywhere (same key), placed replicated on the mesh.
    k1, k2 = jax.random.split(jax.random.key(0))
    params = jax.device_put(
      {
        "w1": jax.random.normal(k1, (16, 32), jnp.float32) / 4.0,
        "w2": jax.random.normal(k2, (32, 1), jnp.float32) / np.sqrt(32.0),
      },
      replicated,
    )
    # A high initial scale, so that the first steps overflow float16 and are skipped.
    tx = jls.dynamic_loss_scale(optax.adam(1e-2), init_scale=2.0**24, growth_interval=20)
    # Eager init: the scale state is placed like the params (global, replicated),
    # so checkpointing libraries (Orbax) can save it from every process.
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
      def scaled_loss(params):
        loss = loss_fn(params, x, y)
        return jls.scale_loss(loss, opt_state), loss

      (_, loss), grads = jax.value_and_grad(scaled_loss, has_aux=True)(params)
      updates, opt_state = tx.update(grads, opt_state, params)  # no axis_name under jit
      return optax.apply_updates(params, updates), opt_state, loss, jls.metrics(opt_state)

    first = None
    for step in range(steps):
      params, opt_state, loss, m = train_step(params, opt_state, x, y)
      # float() reads this process's copy of a replicated global scalar.
      if first is None and not bool(m["last_step_skipped"]):
        first = float(loss)
      if step % max(1, steps // 6) == 0 or step == steps - 1:
        print(
          f"[process {me}] step {step:3d}  loss {float(loss):.5f}  "
          f"scale {float(m['scale']):>10.0f}  skipped {int(m['skipped_steps'])}",
          flush=True,
        )
      # Between steps, every process may stop a diverged run; all of them see the same
      # counters, so all stop at the same step.
      jls.check_skips(opt_state, max_consecutive_skips=50)

    final = float(jax.jit(loss_fn)(params, x, y))
  skipped = int(m["skipped_steps"])
  print(
    f"[process {me}] final loss {final:.5f} (first applied step {first:.5f}), "
    f"scale {float(m['scale']):.0f}, skipped steps {skipped}",
    flush=True,
  )
  ok = first is not None and final < 0.5 * first and skipped > 0
  if not ok:
    print(
      f"[process {me}] FAILED: the loss did not go down, or no overflow was handled", flush=True
    )
  return ok


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch_local(argv, timeout=300):
  """Starts this script as LOCAL_PROCESSES workers on 127.0.0.1 and relays their output."""
  port = _free_port()
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={LOCAL_DEVICES}",
  )
  procs, outs = [], []
  try:
    for i in range(LOCAL_PROCESSES):
      out = tempfile.TemporaryFile(mode="w+")
      outs.append(out)
      procs.append(
        subprocess.Popen(
          [
            sys.executable,
            os.path.abspath(__file__),
            *argv,
            "--process-id",
            str(i),
            "--coordinator",
            f"127.0.0.1:{port}",
          ],
          stdout=out,
          stderr=subprocess.STDOUT,
          env=env,
          text=True,
        )
      )
    # Wait for all; if one fails, the others would wait for it in a collective: stop them.
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      codes = [p.poll() for p in procs]
      if None not in codes or any(c not in (None, 0) for c in codes):
        break
      time.sleep(0.1)
  finally:
    for p in procs:  # never leave a worker behind
      if p.poll() is None:
        p.kill()
        p.wait()
  codes = [p.returncode for p in procs]
  for i, out in enumerate(outs):
    out.seek(0)
    lines = [ln for ln in out.read().splitlines() if not ln.startswith("[Gloo]")]
    out.close()
    shown = lines if codes[i] == 0 else lines[-40:]
    print("\n".join(ln for ln in shown if ln.startswith("[process") or codes[i] != 0))
  if codes != [0] * len(procs):
    print(f"FAILED: worker exit codes {codes}", file=sys.stderr)
    return 1
  return 0


def main(argv=None):
  argv = sys.argv[1:] if argv is None else argv
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--smoke", action="store_true", help="2 local processes x 4 CPU devices, a few seconds"
  )
  parser.add_argument(
    "--cluster",
    action="store_true",
    help="one process of a cluster job: jax.distributed.initialize() "
    "reads the job from the environment (SLURM, Kubernetes, ...)",
  )
  parser.add_argument("--steps", type=int, default=None)
  parser.add_argument("--process-id", type=int, default=None, help=argparse.SUPPRESS)
  parser.add_argument("--coordinator", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  steps = args.steps or (60 if args.smoke else 500)

  if args.cluster:
    jax.distributed.initialize()  # coordinator, process count and id from the environment
  elif args.process_id is None:  # the local launcher
    return launch_local(argv)
  else:  # one local worker
    # CPU only: cross-process collectives through gloo (GPUs use NCCL by themselves).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
      args.coordinator,
      num_processes=LOCAL_PROCESSES,
      process_id=args.process_id,
      coordinator_bind_address=args.coordinator,
    )  # 127.0.0.1 only
  try:
    ok = train(steps)
  finally:
    jax.distributed.shutdown()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
