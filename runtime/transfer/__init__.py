"""Moving KV between layouts and engines: host-side cache layouts, the prefill -> decode transfer plan, NIXL."""
