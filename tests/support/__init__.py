"""Test support shared by every tier, imported as `support.<module>`.

The pytest configuration puts `tests/` on `sys.path` (`pythonpath` in pyproject.toml), so
test modules and conftests of any tier import from here; nothing in the product imports it.

- `waiting`: `wait_for`, the one way tests wait for something they can observe.
- `binaries`: the control-plane binaries, announced on stderr before a build.
- `helm`: the helm binary of the control-plane build.
- `cluster`: kubectl helpers and FineTuneJob helpers for the local control plane.
- `apiserver`: `Api`, plain HTTPS to a local kube-apiserver.
- `e2e_targets`: where the e2e tier runs (the local control plane or a kind cluster).
- `podsecurity`: the `restricted` Pod Security Standard of the namespaces jobs run in: the
  namespace, a compliant container securityContext, a checker for pod specs.
- `trainer`: trainer configs and logs, the environment of trainer processes.
- `reconcile`: a job, what the cluster shows, and one step of the control loop, for the
  reconcile and lifecycle unit tests.
- `statuses`: status parts in wire form (a plan), for the metrics and vocabulary tests.
- `kmock_apiserver`: KMock's Kubernetes emulator made to behave like kube-apiserver.
- `scripts`: `load_script`, a script of benchmarks/ or hack/ imported as a module.
"""
