"""A mini-kubelet for one designated node: runs the pods bound to it as local processes.

Test and demo infrastructure, not part of the product. The local control plane simulates GPU
nodes with kwok, which only pretends to run pods; this runner plays the kubelet of *one* real node
so that the trainer actually trains in the e2e tier and in `kubetune demo`::

    python -m kubetune_dev.podrunner --kubeconfig K --node NAME --work DIR \\
        [--volumes-root R] [--pod-ip-base 127.0.100.] [--labels k=v,...] \\
        [--taints k=v:Effect,...] [--gpus N] [--cpu N] [--memory 16Gi]

What it does, like a kubelet:

- registers the Node (not kwok-annotated, so kwok leaves it alone) with the given labels,
  taints and capacity. `nvidia.com/gpu` is a *simulated* count so that GPU pods schedule here;
  the processes run on the CPU. It renews the node's Lease in `kube-node-lease` and the Ready
  condition's heartbeat every 10 s, so the node-lifecycle controller keeps it Ready;
- polls the pods with `spec.nodeName == NAME` every 0.5 s and, for a new pod, materialises its
  volumes (configMap, secret, downwardAPI, projected incl. service-account tokens, emptyDir,
  hostPath, persistentVolumeClaim → the bound PV's hostPath), resolves its env (value with
  `$(VAR)` expansion, envFrom, fieldRef, resourceFieldRef, configMapKeyRef, secretKeyRef), gives
  it a loopback IP (`127.0.100.2`, `.3`, ...: all of 127/8 is loopback on Linux) and runs its init
  containers one after the other, then all its containers at once, each as a local process;
- runs each container in private mount, UTS and PID namespaces: the pod's volumes bind-mounted
  at their mount paths, a per-pod `/etc/hosts` (the pod's and its siblings'
  `<hostname>.<subdomain>` names, siblings on other nodes included), a per-container
  termination-message file at `terminationMessagePath`, the pod's hostname, and the command
  as PID 1, so that everything it started dies with it (torchrun puts its workers in sessions
  of their own). Without
  CAP_SYS_ADMIN it falls back to a path map: the process runs in the host's namespaces and
  `$KUBETUNE_PATH_MAP` (JSON, mountPath → host path) says where each volume is; nothing is
  rewritten;
- reports pod status through `pods/status` (phase, conditions, podIP, startTime, container
  states with exit code, reason Completed/Error/OOMKilled/StartError and the termination
  message) and emits the usual Events (Started, Killing, FailedMount);
- on `deletionTimestamp` (delete, eviction, Job controller) sends SIGTERM to each container's
  main process, SIGKILL to all of the container after the grace period, reports the terminated
  status and then deletes the pod with grace period 0, as the kubelet does; a pod whose object
  vanished is killed at once;
- on SIGTERM/SIGINT kills every container it started, reports them terminated and exits.

What it does not do: images are ignored (the container's `command` runs with the runner's
Python environment on PATH; a container without `command` fails with StartError);
securityContext (runAsUser, readOnlyRootFilesystem, capabilities) and resources are not enforced
(processes run as the runner's user); probes and lifecycle hooks are not run (a running
container is ready); restartPolicy is treated as Never (containers are never restarted);
containerPorts are not isolated (each pod has its own loopback IP, but a process that binds
0.0.0.0 shares the port space with every other pod); there is no cluster DNS, so Services
resolve only through the per-pod `/etc/hosts`; `kubectl logs`/`exec` do not work: each
container's stdout and stderr go to `DIR/<namespace>_<pod>/<container>.log`.

The modules, each importing only those listed before it:

- `podspec`: the pod spec read without side effects: quantities, `$(VAR)` expansion, field and
  resource references, a container's env and argv, the hostname and /etc/hosts text;
- `status`: the status reported for a pod: container states, phase, conditions, exit reasons,
  termination messages;
- `node`: the Node this runner plays: labels and taints flags, capacity, Node status, Lease;
- `volumes`: what backs each pod volume on this machine, and each container's bind mounts
  (or the path map that stands in for them);
- `sandbox`: the helper that becomes a container's process: namespaces through ctypes, bind
  mounts, hostname, the command as PID 1;
- `api`: the small REST client and `ApiLookup`, the `podspec.Lookup` it backs;
- `runner`: `PodRunner`, the loop: node registration and heartbeat, then admit, prepare,
  start, collect, terminate, report and delete each pod;
- `__main__`: the command line, and the `--exec-container` entry of the helper.

See docs/local-pod-runner.md.
"""
