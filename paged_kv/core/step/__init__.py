"""The step: what turns a scheduler's decision into owner changes and a `StepBatch`.

- `parse`   validate the caller's ``{seq_id: tokens or count}`` (changes nothing)
- `plan`    what a step or an admission takes, and the one "requested > obtainable" check
- `commit`  allocate, copy on write, extend rows, index the blocks that filled
- `decode`  the decode step's page-table bookkeeping (numpy, or compiled with numba)
- `prefix`  prefix keys: a prompt's cached blocks, indexing blocks as they fill
- `batch`   `StepBatch`, the step's page table in the forms kernels read

See `paged_kv.core.step.plan` for how the phases run.
"""
