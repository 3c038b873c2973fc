"""Run simulator: sizes a cluster run before it is launched (tools/simulate_run.py).

    config.py    typed settings (cluster, servers, learner, sync, lengths, buffer scheme)
    costs.py     time formulas: batched decode speed, learner step from FLOPs, weight sync
    lengths.py   response lengths: capped lognormal, or measured lengths from a JSONL file
    servers.py   inference servers as processor sharing; least-outstanding routing
    engine.py    the event loop around the production LagAwareBuffer and the learner loop
    result.py    utilisation, throughput, lag histogram and drops of one simulation
    sweep.py     both schemes across cluster sizes; the rollout/learner split for a lag
    validate.py  predict a finished run's lag and drops from its logged step and sync times
    plot.py      the PNG figures;  cli.py  the command line

Imports flow down this list. The simulator reuses the training code's buffer, config schemas,
layout planner and model specs; nothing outside this package imports it.
"""
