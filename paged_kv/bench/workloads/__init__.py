"""The six workloads of ``paged-kv bench``; each module's ``run`` returns a `WorkloadResult`."""
