"""The scheduler actor: request state, the KV block table and the step loop."""
