"""The API layer: what users and the cluster see.

`v1alpha1` holds the `FineTuneJob` and `GPUPool` types (the single source of the CRDs, which
`crdgen` renders), `vocabulary` the closed sets of words the operator writes into status,
Events and metrics (phases, condition types, reasons), and `errors` the domain errors every
layer above raises. Nothing here imports more of kubetune than the trainer's contract.
"""
