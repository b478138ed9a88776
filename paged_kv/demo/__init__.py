"""``paged-kv demo``: a realistic workload served and reported, in one place.

- `run`: serve the demo's workload on a model through the `Engine` (`run_demo`);
- `workload`: the demo's seeded requests (`make_workload`);
- `report`: the run's figures as a dict and as the printed table (`format_report`);
- `synthetic`: ``--synthetic``, the cache driven alone (no model) through a synthetic
  workload (`run_synthetic`).
"""
