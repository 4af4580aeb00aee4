"""The workload mapper, ``specserve map``: a sample of the user's traffic in, a crossover map,
plots and a calibrated serve config out.

``traffic`` (rows per segment) -> ``profile`` (phase 1: α by position, c, v per segment ×
drafter, in process) -> ``sweep`` (phase 2: fixed-spec vs fixed-plain per concurrency through the
real service) -> ``crossover`` + ``cost_model`` + ``decide`` (phase 3: crossover per segment,
knobs) -> ``write`` / ``plots`` / ``report`` (files). ``run`` drives the phases; ``progress``
holds the bars and the time budget. The command line is ``cluster.commands.map``.
"""
