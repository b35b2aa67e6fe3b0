"""Worlds, launch and collectives: threaded and torchrun worlds, group roles, the Neuron backend."""
