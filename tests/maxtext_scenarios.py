"""What each process of the MaxText test job runs (tests/test_maxtext.py).

`train(args)` runs under emergency_ckpt.demo.launcher, which has already
called jax.distributed.initialize on a free port (so MaxText skips its own
CPU initialisation and its fixed coordinator port 1234). It installs
emergency_ckpt as MaxText's emergency checkpointer and runs MaxText's real
train entry point, `maxtext.trainers.pre_train.train.main(argv)`.

With args["stop_after_step"] = K, the process waits after MaxText's save of
step K until that save is durable, writes <job out>/stopped_<i> and sleeps:
the test then SIGKILLs every process (a crash right after step K's
checkpoint, at a known step).
"""

from __future__ import annotations

import json
import os
import time

import maxtext

# The tiny decoder: 2 layers, 64 wide, 256 tokens, 32 positions; synthetic data.
TINY_MODEL = (
  "decoder_block=llama2",
  "base_num_decoder_layers=2",
  "base_emb_dim=64",
  "base_mlp_dim=128",
  "base_num_query_heads=4",
  "base_num_kv_heads=4",
  "head_dim=16",
  "vocab_size=256",
  "max_target_length=32",
  "per_device_batch_size=1",
  "dataset_type=synthetic",
  "enable_dropout=false",
  "scan_layers=false",
)


def maxtext_argv(args: dict, process: int) -> list[str]:
  """MaxText's argv for this process: its base.yml plus overrides."""
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  return [
    "train",
    base,
    *TINY_MODEL,
    "hardware=cpu",
    f"run_name={args['run_name']}",
    f"base_output_directory={args['output_dir']}",
    f"steps={args['steps']}",
    # one slice per process: the data axis (size 2) is the replica axis
    f"ici_data_parallelism={args['processes']}",
    f"ici_fsdp_parallelism={args['devices_per_process']}",
    "enable_checkpointing=true",
    "enable_emergency_checkpoint=true",
    "async_checkpointing=true",
    f"local_checkpoint_directory={args['local_root']}/host{process}",
    f"local_checkpoint_period={args['local_period']}",
    f"checkpoint_period={args['persistent_period']}",
    f"metrics_file={args['output_dir']}/metrics_{args['tag']}_{process}.jsonl",
    "log_period=1",
    "enable_tensorboard=false",
    "enable_goodput_recording=false",
    "monitor_goodput=false",
  ]


def _stop_after(factory, step: int, marker: str):
  """Wraps MaxText's manager factory: after save(step), wait until durable,
  mark, and sleep until the test kills this process."""

  def create(*a, **k):
    manager = factory(*a, **k)
    save = manager.save

    def save_then_stop(s, args, *, force=False, **kw):
      saved = save(s, args, force=force, **kw)
      if s == step:
        manager.wait_until_finished()
        with open(marker, "w") as f:
          f.write(str(s))
        while True:
          time.sleep(1)
      return saved

    manager.save = save_then_stop
    return manager

  return create


def train(args: dict) -> dict:
  import jax  # noqa: PLC0415
  from maxtext.common import checkpointing, emergency_checkpointing  # noqa: PLC0415
  from maxtext.trainers.pre_train import train as maxtext_train  # noqa: PLC0415

  from emergency_ckpt.demo.job_process import job_output_dir  # noqa: PLC0415
  from emergency_ckpt.integrations import maxtext as integration  # noqa: PLC0415

  process = jax.process_index()
  integration.install(
    overrides=[
      f"event_log={args['output_dir']}/events_{args['tag']}_{{process}}.jsonl",
      f"host_id=simulated-host-{process}",  # one machine here; a host per slice in real life
    ]
  )
  if args.get("stop_after_step") is not None:
    marker = os.path.join(job_output_dir(), f"stopped_{process}")
    factory = _stop_after(
      emergency_checkpointing.create_emergency_checkpoint_manager, args["stop_after_step"], marker
    )
    emergency_checkpointing.create_emergency_checkpoint_manager = factory
    checkpointing.create_orbax_emergency_checkpoint_manager = factory
  _start_together()
  maxtext_train.main(maxtext_argv(args, process))
  return {"process": process}


def _start_together(timeout_s: int = 300) -> None:
  """Waits until every process is here (after the slow imports), through the
  coordination service: JAX's CPU collectives (gloo) give a process only 30 s
  to join a new communicator, so on a loaded machine processes that start
  training far apart fail MaxText's first collective (DEADLINE_EXCEEDED in
  "Gloo context initialization"). Private JAX API; test harness only."""
  from jax._src import distributed  # noqa: PLC0415

  distributed.global_state.client.wait_at_barrier("ec_maxtext_start", timeout_s * 1000)


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]
