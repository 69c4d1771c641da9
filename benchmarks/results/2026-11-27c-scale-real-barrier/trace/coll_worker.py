import time


def worker(args):
  import jax
  import numpy as np
  from emergency_ckpt.topology import Collectives, topology_from_mesh
  from jax.sharding import Mesh

  mesh = Mesh(np.array(jax.devices()).reshape(args["slices"], -1), ("replica", "data"))
  topo = topology_from_mesh(mesh, "replica")
  c = Collectives(topo, namespace="exp", timeout_s=120)
  out = {}

  def t(name, fn, reps=5):
    ts = []
    for _i in range(reps):
      c.barrier(f"pre-{name}")
      time.sleep(0.2)
      c.barrier(f"pre2-{name}")
      t0 = time.monotonic()
      fn()
      ts.append(time.monotonic() - t0)
    out[name] = ts

  t("barrier", lambda: c.barrier("b"))
  t("gather_sparse", lambda: c.gather_sparse("gs", None))
  t(
    "gather_tree",
    lambda: c.gather_tree(
      "gt", 1, per_slice=lambda s, v: len(v), combine=lambda d: sum(d.values())
    ),
  )
  t(
    "exchange_some",
    lambda: c.exchange_some("es", 1, wanted=[(topo.process_index + 4) % topo.process_count]),
  )
  return out
