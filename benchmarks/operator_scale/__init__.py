"""The operator at scale: many FineTuneJobs at once on the local control plane with kwok.

Starts the local control plane (docs/local-cluster.md) with four simulated GPU pools of the
built-in catalog (rtx4090-spot, l40s, a100-80gb, h100; `--nodes-per-pool` kwok nodes of 8 GPUs
each), `--namespaces` namespaces and the operator as its own process
(`LocalCluster.start_operator`: `python -m kopf run -m kubetune.controller.handlers`, whatever
`kubetune` the interpreter imports). Then `--clients` threads create `--jobs` FineTuneJobs at
once over HTTPS with the kubeconfig's client certificate, every one a different question for
the planner (model, method, sequence length, dataset size, GPU count), and the benchmark waits
until every job that can run is Running with its trainer pods Running, measures a steady-state
window of `--steady-seconds`, and stops the cluster (also on Ctrl-C).

kwok runs its release's "fast" stages without `pod-complete`, so trainer pods stay Running
instead of completing at once, and it gives pods loopback addresses (`--cidr`), so the
operator's scrapes of the trainers' metrics are refused at once instead of leaving the machine.

What it prints, and appends as a row to benchmarks/results/operator-scale-<date>.md (with
every detail, the API request breakdown included, as a JSON line in the .jsonl beside it);
docs/local-cluster.md#the-operator-at-scale says what each column means:

- creation → Planned condition p50/p99 (`lastTransitionTime` − `creationTimestamp`, both the
  API server's clock, 1 s resolution), creation → first trainer pod p50/p99 (the first pod
  labelled `kubetune.io/job=<job>`), jobs/s reaching Planned, jobs never Planned in --timeout;
- the operator's peak RSS and CPU (% of one core) over the steady window, from /proc;
- API requests from the API server's own `apiserver_request_total`, which has no user label:
  every client's requests are in it. The benchmark subtracts its own, those that are never the
  operator's (`never_the_operators`: the local provisioner's, the scheduler's Events) and the
  cluster's background rate, measured in a window of `--background-seconds` after the
  operator is stopped (`beyond_background`).

Usage:
    python -m benchmarks.operator_scale --jobs 500 --label before
    python -m benchmarks.operator_scale --quick          # 50 jobs, short windows, no results row
    python -m benchmarks.operator_scale --planned-floor  # no operator: the least one can do
    python -m benchmarks.operator_scale --planned-floor --floor-launches 250  # ... and launch
"""
