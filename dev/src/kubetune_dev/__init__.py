"""Developer and test tooling: building and running a local Kubernetes control plane."""
