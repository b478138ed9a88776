"""Cache tiers behind the device pool: host RAM, a local disk, a shared Redis.

Full blocks registered in the device's prefix index are written down the tiers in the
background (`TierManager`); a prompt's blocks missing from the device are looked up and
fetched back from them before it is admitted, when the engine's own measured rates say a
fetch beats recomputing, and under a deadline. Every stored value verifies itself
(`codec`): a value whose header or checksum does not match is a miss, never served.

The core (`paged_kv.core.cache` and its owners) knows none of this: the manager reads the
allocator's stored events and the pool's bytes, and loads fetched blocks as cached device
blocks (`paged_kv.core.load_cached`).
"""

from .base import Store, TierConfig
from .codec import Fingerprint

__all__ = ["Fingerprint", "Store", "TierConfig"]
