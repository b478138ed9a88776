"""The workloads of ``paged-kv bench`` (`cli.WORKLOADS` and `cli.OPTIONAL_WORKLOADS`); each
module's ``run`` returns a `WorkloadResult`."""
