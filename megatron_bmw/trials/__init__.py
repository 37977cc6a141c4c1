"""Real trials: grids of Megatron flags or planner plans run for a few iterations each, measured, and compared
with the planner's prediction (`tools/grid_search.py`).

  grid.py      a grid (comma lists on flags, or YAML) or plan files -> trials, each checked before it is run
  runner.py    one trial through torchrun or srun, in its own process group, with a timeout
  logparse.py  Megatron's iteration lines, memory lines, OOM and error lines of a trial's log
  results.py   the results JSONL (one object per trial and attempt; resumable)
  specs.py     a trial as the planner sees it (RunSpec, cluster), for predictions and calibration
  report.py    the table sorted by measured throughput, and the predicted-vs-measured PNG
  sbatch.py    an sbatch script that runs a whole sweep inside one allocation
  cli.py       tools/grid_search.py
  entry.py     what each trial runs: pretrain_gpt.py, then every rank's peak memory (the only module with torch)
"""
