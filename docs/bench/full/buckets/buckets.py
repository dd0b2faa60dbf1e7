"""bucket_cap_mb on 2 fake nodes (one rank each, 1 thread each, shaped link): values alternated."""
import json, sys, tempfile
from pathlib import Path
from cpudist.bench.child import run_json
from cpudist.bench.options import BenchArgs
from cpudist.bench.scaling import bench_command, _env
from cpudist.launch import hostfile as hostfiles, netns
from cpudist.launch.mpi import detect_mpi

link = netns.parse_link(sys.argv[1])
caps = [float(c) for c in sys.argv[2].split(",")]
rounds = int(sys.argv[3])
extra = sys.argv[4:]  # overrides, e.g. dist.grad_compression=bf16
import os
args = BenchArgs(preset="smollm2-135m", layers=int(os.environ["LAYERS"]) if "LAYERS" in os.environ else None, data="synthetic", steps=int(os.environ.get("STEPS", 3)), warmup=1,
                 batch_size=2, seq_len=512, dtype=None, threads=1, method="full")
mpi = detect_mpi()
out = []
with netns.fake_cluster(2, prefix=netns.own_prefix("cpdb"), link=link) as cluster, \
        tempfile.TemporaryDirectory(prefix="cpudist-fake-") as workdir:
    hostfile = str(cluster.write_hostfile(Path(workdir) / "hosts", slots=1))
    for r in range(rounds):
        for cap in caps:
            cmd = bench_command(mpi, 2, None, [*extra, f"dist.bucket_cap_mb={cap:g}",
                                               f"dist.interface={cluster.ifname}"], args, 2, 1,
                                None, hostfile, hostfiles.parse(hostfile), cluster.mpi_args(),
                                bind=False)
            res = run_json(cluster.exec_argv(cluster.nodes[0], cmd), _env(), f"cap {cap}",
                           on_stdout=True)
            row = {"round": r, "bucket_cap_mb": cap, "link": link.describe(), "extra": extra,
                   "tokens_per_s": res.tokens_per_s, "s_per_step": res.s_per_step,
                   "step_s": res.step_s, "comm_exposed_s_per_step": res.comm_exposed_s_per_step,
                   "comm_mb_per_step": res.comm_mb_per_step, "compute_s_per_rank": res.compute_s_per_rank,
                   "wait_for_slowest_s": res.wait_for_slowest_s, "peak_rss_gb": res.peak_rss_gb}
            print(json.dumps(row), flush=True)
            out.append({"row": row, "result": res.to_json()})
Path(sys.argv[0]).with_suffix("").with_name(f"buckets-{link.describe().replace(' ', '_').replace('/', '')}-{'_'.join(extra) or 'fp32'}.json").write_text(json.dumps(out, indent=1))
