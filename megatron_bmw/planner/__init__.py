"""Planner: instruments for choosing a parallel configuration. Pure Python over numbers: importing it does not
load torch (only profiler.py, which measures, does).

cluster.py       cluster descriptions (YAML; built-ins in clusters/), links between GPUs
profiler.py      measured unit times, saved bytes, link speeds; analytic profiles (profile_data.py: the file)
memory_model.py  bytes per rank: model states, activations counted from what our units save, the schedule's peak
cost_model.py    durations of every schedule action and of the gradient synchronisation
simulator.py     executes any schedule with those durations (replay's semantics): time, bubbles, critical
                 path, master stage, memory over time
evaluate.py      one RunSpec (spec.py) -> memory per stage and a simulated iteration
partitioners.py  unit partitions: min-max (AutoPipe), AMP's layer-assignment DP, AutoPipe's refinement, hill
                 climbing, Galvatron's per-unit option knapsack and bi-objective partition walk
report.py        JSON and text tables; timeline.py: PNG timelines
cli.py           tools/autoconfig.py (estimate, simulate, profile)
"""
