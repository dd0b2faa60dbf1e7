"""SmolLM2-135M full fine-tuning on N fake nodes (one rank each, 1 thread), every link shaped to
LINK, or the same N ranks over loopback on this host (LINK = loopback): each NAME=OVERRIDES
setting run in turn on one fake cluster; a JSON line per run, all of them in LINK.json here (or
in the folder OUT names).

  STEPS=2 NODES=4 BATCH=1 python scaleout.py 1gbit plain=dist.bucket_cap_mb=1000 \
      overlap=dist.bucket_cap_mb=25 bf16=dist.bucket_cap_mb=25,dist.grad_compression=bf16
"""
import json
import os
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from cpudist.bench.child import run_json
from cpudist.bench.options import BenchArgs
from cpudist.bench.scaling import _env, bench_command
from cpudist.launch import hostfile as hostfiles
from cpudist.launch import netns
from cpudist.launch.mpi import detect_mpi

link_name = sys.argv[1]
settings = [(name, [o for o in rest.split(",") if o]) for name, _, rest in
            (a.partition("=") for a in sys.argv[2:])]
nodes = int(os.environ.get("NODES", 4))
args = BenchArgs(preset="smollm2-135m", data="synthetic",
                 layers=int(os.environ["LAYERS"]) if "LAYERS" in os.environ else None,
                 steps=int(os.environ.get("STEPS", 2)), warmup=1,
                 batch_size=int(os.environ.get("BATCH", 1)),
                 seq_len=int(os.environ.get("SEQ", 512)), dtype=None, threads=1, method="full")
mpi = detect_mpi()
out = []
with ExitStack() as stack:
    cluster = None
    if link_name != "loopback":
        link = netns.parse_link(link_name)
        cluster = stack.enter_context(netns.fake_cluster(nodes, prefix=netns.own_prefix("cpso"),
                                                         link=link))
        workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="cpudist-fake-"))
        hostfile = str(cluster.write_hostfile(Path(workdir) / "hosts", slots=1))
    for name, overrides in settings:
        if cluster is None:  # the same ranks on this host, over loopback, sharing its cores
            cmd = bench_command(mpi, nodes, None, overrides, args, args.batch_size, nodes, None,
                                bind=False)
            argv = cmd
        else:
            cmd = bench_command(mpi, nodes, None, [*overrides, f"dist.interface={cluster.ifname}"],
                                args, args.batch_size, 1, None, hostfile,
                                hostfiles.parse(hostfile), cluster.mpi_args(), bind=False)
            argv = cluster.exec_argv(cluster.nodes[0], cmd)
        res = run_json(argv, _env(), f"{name} on {link_name}", on_stdout=True)
        row = {"setting": name, "link": link_name, "nodes": nodes, "overrides": overrides,
               "tokens_per_s": res.tokens_per_s, "s_per_step": res.s_per_step,
               "step_s": res.step_s, "comm_exposed_s_per_step": res.comm_exposed_s_per_step,
               "comm_mb_per_step": res.comm_mb_per_step,
               "compute_s_per_rank": res.compute_s_per_rank,
               "wait_for_slowest_s": res.wait_for_slowest_s, "peak_rss_gb": res.peak_rss_gb}
        print(json.dumps(row), flush=True)
        out.append({"row": row, "result": res.to_json()})
        out_dir = Path(os.environ.get("OUT", Path(__file__).parent))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / f"{link_name}.json").write_text(json.dumps(out, indent=1))
