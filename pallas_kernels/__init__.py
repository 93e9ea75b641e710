"""Pallas GPU kernels (packed tree attention, paged decode, gated delta rule), each with a jnp reference."""
