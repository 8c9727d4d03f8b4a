"""The children of a FineTuneJob as manifests, plain dicts (pure: no cluster, no kopf).

One module per kind of object, as the operator applies them: `storage` (the checkpoint and
cache claims, and the volumes `pvc://` URIs name), `config` (the trainer's ConfigMap),
`network` (the headless Service and the NetworkPolicy), `trainer` (the Indexed batch Job),
`stages` (the CPU-only stage-in, export and stage-out steps) and `children` (a training
attempt's children in apply order). Below them: `names` (names, labels, owner references),
`env` (container environment), `paths` (where things are inside the pods) and `settings`
(`BuildSettings`). Import a name from the module that owns it; this package re-exports
nothing. `docs/trainer-pods.md` explains every choice made here for the people who run the
cluster.
"""
