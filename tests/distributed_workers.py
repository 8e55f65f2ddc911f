"""Runs a worker script as N local processes joined by `jax.distributed` (CPU, gloo): multi-host tests.

The script gets its process id and the coordinator's port as `sys.argv[1:3]`, starts with `PREAMBLE` (which
initialises the distributed runtime through `multihost.maybe_initialize_distributed`) and prints one line
`RESULT <json>`; `run_workers` returns each process's JSON, in process order, and fails the test with the
worker's output when one exits non-zero.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap

PREAMBLE = textwrap.dedent("""
    import json, sys
    process_id, port = int(sys.argv[1]), sys.argv[2]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    from transformer_jax import multihost, sharding
    multihost.maybe_initialize_distributed(True, coordinator_address=f"localhost:{port}", num_processes=NUM_PROCESSES,
                                           process_id=process_id)
""")


def start_workers(script: str, tmp_path, *, num_processes: int = 2, devices_per_process: int = 1,
                  args: tuple[str, ...] = (), log_to=None) -> list[subprocess.Popen]:
  """`PREAMBLE + script` started in `num_processes` processes of `devices_per_process` CPU devices each; their
  output goes to pipes, or with `log_to` (a directory) to `log_to/<process>.log` (a process nobody reads from
  then never blocks on a full pipe)."""
  worker = tmp_path / "worker.py"
  worker.write_text(PREAMBLE.replace("NUM_PROCESSES", str(num_processes)) + textwrap.dedent(script))
  with socket.socket() as s:
    s.bind(("localhost", 0))
    port = s.getsockname()[1]
  tests = os.path.dirname(os.path.abspath(__file__))
  root = os.path.dirname(tests)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([root, tests]),
             XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") +
                        f" --xla_force_host_platform_device_count={devices_per_process}").strip())
  return [subprocess.Popen([sys.executable, str(worker), str(i), str(port), *args], env=env, cwd=root,
                           stdout=open(log_to / f"{i}.log", "w") if log_to else subprocess.PIPE,
                           stderr=subprocess.STDOUT, text=True)
          for i in range(num_processes)]


def run_workers(script: str, tmp_path, *, num_processes: int = 2, devices_per_process: int = 1,
                timeout: float = 180, args: tuple[str, ...] = ()) -> list[dict]:
  """`PREAMBLE + script` in `num_processes` processes of `devices_per_process` CPU devices each."""
  procs = start_workers(script, tmp_path, num_processes=num_processes, devices_per_process=devices_per_process,
                        args=args)
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=timeout)[0])
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
  results = []
  for proc, out in zip(procs, outputs):
    assert proc.returncode == 0, out[-3000:]
    results.append(json.loads(out.split("RESULT ", 1)[1].splitlines()[0]))
  return results
