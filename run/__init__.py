"""run/ — a run's set-up, supervision and reports, and the roles beyond one node.

Files
    prepare.py: what a run settles before any process starts: flags checked, model and tasks
        resolved, the weight buffer laid out
    flag_checks.py: the checks that read the flags alone, one line per bad value
    launch.py: the parent process of `python train.py`: spawn the generator and the ranks,
        supervise, merge the trace
    metrics.py: one JSON row per step, the progress line, wandb, summary.json
    plots.py: OUT/plots.png and the timeline (`python -m run.plots OUT`)
    trace_merge.py: the processes' trace files joined into OUT/trace.json (copyable alone)
    remote.py, remote_generator.py, link.py: more than one node (`--role trainer|generator`)
Data flows one way: train.py calls into run/; run/ may import every other part (it starts them)
and nothing imports run/ but train.py. May touch: everything under --out; child processes.
"""
