"""The control layer (pure): what the operator does next for one FineTuneJob.

`reconcile` reads a job and what the cluster shows of it and returns a `Decision` (new
status, children to create, batch Jobs to delete, Events); `build` renders the children
as manifests, one module per kind of object; `conditions` keeps metav1.Condition semantics.
No kopf, no Kubernetes client: the controller layer above gathers what is observed and
carries out the decision.
"""
