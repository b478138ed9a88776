"""The cache core: the facade and the owners it composes, with no HTTP, ranks, sockets or
stores in it.

- `cache`        `PagedKVCache`, the facade (every mutation goes through it), and
  `admission`    its admissions (plan once, commit that plan)
- `allocator`    block ids, refcounts, the prefix index
- `eviction`     the eviction policy the allocator calls (plain LRU; tenants' ledger too)
- `page_table`   per-sequence rows of block ids and token counts
- `pool`         the preallocated K/V tensors
- `swap`         the host pool swapped-out sequences move to
- `accounting`   where every block and byte is
- `layer_access` the worker side: writes, gathers and attention over one layer's pages
- `load_cached`  blocks a lower tier fetched, put into the pool as cached blocks
- `batch`        `StepBatch`, a step's page table in the forms kernels read
- `decode_rows`  the decode step's page-table bookkeeping (numpy, or numba)
- `step`         a step's parse -> plan -> check -> commit over the owners
- `groups`       layer groups: one class per layer kind (full, sliding, chunked,
                 recurrent state), the layout over several groups
"""
