"""The planning layer (pure): how much memory a job needs, how fast it runs, where it goes.

    models_table ─┬─▶ arch ─▶ estimator ─┐
    families ─────┘           throughput ────┼─▶ planner
                              catalog ───────┘

`arch` turns a Hugging Face `config.json` (parsed elsewhere: `kubetune.sources` reads files
and the hub) into shapes and parameter counts, with what `families` knows of each model
family; `estimator` sizes one configuration's peak GPU memory; `throughput` its time and
cost; `planner` (a package: plans, configs, context, limits, choice, search) searches pools ×
GPU layouts × methods for the best plan and explains every rejected pool. `catalog` is the
built-in pool list.
"""
