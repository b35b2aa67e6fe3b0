"""Disaggregated prefill -> decode KV transfer over NIXL: agent, build, handshake, descriptors,
the prefill and decode connectors, and the loopback harness (spec: "Disaggregated Inference")."""
