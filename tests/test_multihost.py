"""Multi-host tensor parallelism on CPU: two processes on localhost, two host devices each, one global mesh.

Each process is this file run as a script with ``JAX_COORDINATOR_ADDRESS`` / ``JAX_NUM_PROCESSES`` /
``JAX_PROCESS_ID`` set; it joins the job through the project's own ``sharding.initialize_distributed`` (JAX
0.11.2's CPU client uses gloo collectives across processes by default), loads the tiny fixture with
``tensor_parallel=4`` (the model group spans both processes, so every all-reduce crosses them), and writes what it
computed to ``OUT/process{i}.json``; the tests compare that with the unsharded single-process target. The
engine's host loop runs as SPMD: both processes submit the same requests in the same order and step in lock-step
(the server does not do this: it is single-controller).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "fixtures", "qwen36_tiny_a")
N_PROC, LOCAL_DEVICES, TP = 2, 2, 4
PROMPTS = [[5, 17, 3, 99, 42, 7, 128, 64, 1, 200, 33], [9, 8, 7, 6, 5, 4, 3]]
N_NEW = 6

if __name__ != "__main__":
    import numpy as np
    import pytest
    from conftest import xla_flags

    pytestmark = pytest.mark.xdist_group("multihost")

    def _free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    @pytest.fixture(scope="module")
    def results(tmp_path_factory) -> list[dict]:
        out = tmp_path_factory.mktemp("multihost")
        for rc, log in _job([__file__, str(out)]):
            assert rc == 0, log[-6000:]
        return [json.loads((out / f"process{i}.json").read_text()) for i in range(N_PROC)]

    def _job(argv: list[str], timeout: float = 300) -> list[tuple[int, str]]:
        """Run ``python argv`` as the ``N_PROC`` processes of one JAX job on localhost; (exit code, output) each."""
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "OPENBLAS_NUM_THREADS": "1",
               "XLA_FLAGS": xla_flags(LOCAL_DEVICES),
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_free_port()}", "JAX_NUM_PROCESSES": str(N_PROC),
               "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")])}
        logs = [tempfile.TemporaryFile("w+") for _ in range(N_PROC)]  # not pipes: a full one would stall a process
        procs = [subprocess.Popen([sys.executable, *argv], env={**env, "JAX_PROCESS_ID": str(i)},
                                  stdout=log, stderr=subprocess.STDOUT, text=True) for i, log in enumerate(logs)]
        try:
            for p in procs:
                p.wait(timeout)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        out = []
        for p, log in zip(procs, logs):
            log.seek(0)
            out.append((p.returncode, log.read()))
            log.close()
        return out

    @pytest.fixture(scope="module")
    def reference() -> dict:
        import dflash_jax as dj

        t = dj.load_target(FIXTURE, dtype="float32")
        return {"logits": [np.asarray(t.logits(p)) for p in PROMPTS],
                "greedy": [t.greedy(p, N_NEW) for p in PROMPTS]}

    def test_processes_join_one_global_mesh(results):
        for i, r in enumerate(results):
            assert r["joined"] and r["process_index"] == i and r["process_count"] == N_PROC
            assert r["device_count"] == N_PROC * LOCAL_DEVICES and r["local_device_count"] == LOCAL_DEVICES
            assert r["mesh_processes"] == [0, 0, 1, 1]  # the model axis spans both processes

    def test_loader_writes_only_this_process_shards(results):
        """Each process holds exactly its own devices' shards: for the vocabulary-split embedding, the j-th
        device of the model axis holds rows ``[j * V / TP, (j + 1) * V / TP)``, equal to the checkpoint's rows."""
        order = results[0]["mesh_device_ids"]
        vocab = results[0]["vocab"]
        seen = {}
        for r in results:
            assert r["mesh_device_ids"] == order
            assert r["plan"]["attn"] and r["plan"]["vocab"]
            assert sorted(int(d) for d in r["embed_shards"]) == sorted(r["local_device_ids"])
            for d, (lo, hi, ok) in r["embed_shards"].items():
                assert ok and hi - lo == vocab // TP
                seen[int(d)] = lo
        assert [seen[d] for d in order] == [j * vocab // TP for j in range(TP)]

    @pytest.mark.parametrize("i", range(len(PROMPTS)))
    def test_sharded_logits_across_processes_equal_unsharded(results, reference, i):
        for r in results:  # every process sees the same global logits
            got = np.asarray(r["logits"][i], np.float32)
            np.testing.assert_allclose(got, reference["logits"][i], atol=1e-4, rtol=0)

    def test_greedy_across_processes_equals_unsharded(results, reference):
        for r in results:
            assert r["greedy"] == reference["greedy"]

    def test_engine_tp4_across_processes_equals_unsharded_greedy(results, reference):
        for r in results:
            assert r["engine_tp4"] == reference["greedy"]

    def test_engine_dp2_x_tp2_one_replica_per_process_equals_unsharded_greedy(results, reference):
        for r in results:
            assert sorted(r["dp_replicas"]) == [0, 1]  # the two requests ran on different replicas ...
            assert r["dp_replica_processes"] == [[0], [1]]  # ... each replica on the devices of one process
            assert r["engine_dp2_tp2"] == reference["greedy"]

    def test_server_refuses_to_start_as_one_process_of_a_multi_host_job():
        """The server is single-controller: started on every process of a job it would take different requests
        on each and their collectives would not match, so each process exits at start-up saying so."""
        for i, (rc, log) in enumerate(_job(["-m", "dflash_jax.serve", "--model", FIXTURE, "--tensor-parallel", "4"],
                                           timeout=120)):
            assert rc != 0 and f"process {i} of a {N_PROC}-process JAX job" in log, log[-3000:]
            assert "does not serve across hosts" in log


# ---------------------------------------------------------------------------------------------------------------
# one process of the job
# ---------------------------------------------------------------------------------------------------------------
def _main(out_dir: str) -> None:
    from dflash_jax.sharding import initialize_distributed

    joined = initialize_distributed()  # before anything touches jax.devices()

    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    import dflash_jax as dj
    from dflash_jax.config import TargetConfig

    res: dict = {"joined": joined, "process_index": jax.process_index(), "process_count": jax.process_count(),
                 "device_count": jax.device_count(), "local_device_count": jax.local_device_count(),
                 "local_device_ids": [d.id for d in jax.local_devices()]}
    t = dj.load_target(FIXTURE, dtype="float32", tensor_parallel=TP)
    lay = t.layout
    res["mesh_processes"] = [d.process_index for d in lay.mesh.devices.flat]
    res["mesh_device_ids"] = [d.id for d in lay.mesh.devices.flat]
    res["plan"] = {"attn": lay.plan.attn, "gdn": lay.plan.gdn, "mlp": lay.plan.mlp, "vocab": lay.plan.vocab}

    # the loader's placement: which rows of the embedding this process holds, checked against the checkpoint
    from safetensors.numpy import load_file

    cfg = TargetConfig.from_file(FIXTURE)
    res["vocab"] = cfg.vocab_size
    ckpt = load_file(os.path.join(FIXTURE, "model.safetensors"))
    embed = next(v for k, v in ckpt.items() if k.endswith("embed_tokens.weight"))
    res["embed_shards"] = {}
    for s in t.params["embed"].addressable_shards:
        rows = s.index[0]
        res["embed_shards"][s.device.id] = (rows.start, rows.stop,
                                            bool(np.array_equal(np.asarray(s.data), embed[rows])))

    # logits of the global (vocabulary-split) output, gathered to every process; greedy from the same pass
    res["logits"] = [np.asarray(multihost_utils.process_allgather(t.logits(p), tiled=True)).tolist()
                     for p in PROMPTS]
    res["greedy"] = [t.greedy(p, N_NEW) for p in PROMPTS]

    # the engine's host loop, run in lock-step by both processes (same requests, same order): TP=4 over the
    # global mesh, then data x tensor 2 x 2 (one replica per process; each step's rows gathered across processes)
    from dflash_jax.engine.loop import Engine, EngineOptions, SamplingParams

    sp = SamplingParams(max_tokens=N_NEW, ignore_eos=True)
    opts = dict(max_batch=2, prefill_batch=2, prefill_chunk=16, max_model_len=48, page_size=8)
    res["engine_tp4"] = [o.token_ids for o in Engine(t, None, EngineOptions(tensor_parallel=TP, **opts))
                         .generate(PROMPTS, sp)]
    t22 = dj.load_target(FIXTURE, dtype="float32", tensor_parallel=2, data_parallel=2)
    eng = Engine(t22, None, EngineOptions(tensor_parallel=2, data_parallel=2, **opts))
    rids = [eng.submit(p, sp) for p in PROMPTS]
    eng._admit()
    res["dp_replicas"] = [eng.running[i].replica for i in rids]
    res["dp_replica_processes"] = [sorted({d.process_index for d in eng.layout.mesh.devices[r]}) for r in range(2)]
    final = {}
    while eng.has_work():
        final.update({o.request_id: o.token_ids for o in eng.step() if o.finish_reason is not None})
    res["engine_dp2_tp2"] = [final[i] for i in rids]
    with open(os.path.join(out_dir, f"process{jax.process_index()}.json"), "w") as f:
        json.dump(res, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    _main(sys.argv[1])
