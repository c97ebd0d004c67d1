"""Spindle (arXiv 2409.03365): several tasks that share modules, run in waves of device groups of different
sizes. `graph` contracts the tasks' layers into MetaOps, `scalability` prices each op against its device count,
`allocator` solves the continuous allocation and discretises it, `schedule` packs ops into stages,
`placement` maps stages onto devices and `plan` puts them together with the baselines."""
