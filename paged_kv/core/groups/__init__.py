"""Layer groups: one block table per group of same-kind layers, in one pool.

- `groups`     `LayerGroup`, what every kind shares (rows, give-back, fork, removal)
- `kinds`      one class per layer kind (full attention, sliding window, chunked,
               recurrent), chosen by `LayerKind.attention`: a new kind is a new class there
- `state_group` `StateGroup`, the recurrent layers' group: a live state slot per row,
               prefix hits only where a state checkpoint sits
- `state`      the state slab's slots (free, live, checkpoints and their eviction
               policy), its tensors, and a step's `StateBatch`
- `admission`  one prefix hit every group accepts, then one row per group
- `layout`     `GroupLayout`, a step, swap, accounting and check over several groups
- `rules`      `group_key`, the key a group's block is indexed under
"""
