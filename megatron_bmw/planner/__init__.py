"""Planner: instruments for choosing a parallel configuration. Pure Python over numbers: importing it does not
load torch (tests/test_layering.py checks); measuring is training/profiler.py's.

cluster.py       cluster descriptions (YAML; built-ins in clusters/), links between GPUs
analytic.py      profiles from FLOPs for a device that is not here, and a measured profile's settings
profile_data.py  the profile file: unit times, saved bytes, link speeds, overhead
memory_model.py  bytes per rank: model states, the activations a rank holds under the schedule, its peak
unit_activations.py  what one unit holds per micro-batch: the tensors it saves, what B keeps for W, backward buffers
cost_model.py    durations of every schedule action (compute); comm_cost.py the collectives, transfers and the
                 gradient synchronisation; core_sharing.py CPU ranks sharing cores
simulator.py     executes any schedule with those durations (replay's semantics): time, bubbles, critical
                 path, master stage, memory over time
evaluate.py      one RunSpec (spec.py) -> memory per stage and a simulated iteration
partitioners.py  unit partitions: min-max (AutoPipe), AMP's layer-assignment DP, AutoPipe's refinement, hill
                 climbing, Galvatron's bi-objective partition walk; option_knapsack.py its per-unit option knapsack
solver.py        one layout's partition and recomputation under memory; schedule_shapes.py what a search works
                 out once per schedule
report.py        JSON and text tables; timeline.py: PNG timelines
accuracy.py      predicted against measured times: median error, Spearman, the pick's cost
calibrate.py     fits a profile's corrections to measured trials
"""
