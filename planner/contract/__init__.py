"""What both halves read: the plan schema, the rules they must agree on, model/layer specs, workload and strategy
types, packing, units, versioned JSON, the trace format, dataset rows, the device description, parameter counts and
the families' config readers. Pure Python (pydantic, numpy): no torch, no OR-Tools."""
