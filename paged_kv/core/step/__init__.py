"""The step: what turns a scheduler's decision into owner changes and a `StepBatch`.

- `parse`   validate the caller's ``{seq_id: tokens or count}`` (changes nothing)
- `plan`    what a step or an admission takes, and the one capacity check (`check_capacity`)
- `commit`  allocate, copy on write, extend rows, index the blocks that filled
- `prefix`  prefix keys: a prompt's cached blocks, indexing blocks as they fill

The step's `StepBatch` and the decode step's table bookkeeping sit with the owners they
serve (`paged_kv.core.batch`, `paged_kv.core.decode_rows`): the owners import neither the
step nor anything above it.

See `paged_kv.core.step.plan` for how the phases run.
"""
